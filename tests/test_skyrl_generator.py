"""SkyRL 0.3.0's own code driving rollout-bus through
`trainer_bridge.skyrl.RolloutBusEngine` on a CPU cluster (issue 23):

- its `SkyRLGymGenerator`, multi-turn (session ids, finish_session, loss
  masks) and batched, with SkyRL's own sampling params and chat templating;
- the Tinker `sample({"json": body})` request SkyRL's Tinker backend sends,
  built from SkyRL's own Tinker types, then `aclose()`;
- its own weight-sync strategy (`get_transfer_strategy_cls` → CUDA IPC
  strategy → `CudaIpcWeightTransferSender.send_chunks`, unmodified) with
  rollouts in flight: start_weight_update / update_weights_ipc /
  finish_weight_update. CPU: torch.cuda's device queries point at the CPU
  (no other change: torch's `reduce_tensor` shares CPU tensors as well);
  SkyRL's default `weight_sync_backend="nccl"` on CPU is a typed error;
- the colocated order sleep → wake_up(weights) → sync → wake_up(kv_cache);
- cancelling the generator's task stops the requests on the engines.

Runs where `skyrl` and `skyrl_gym` import (`.ci/run` installs them, see
CONTRIBUTING.md); skipped with the reason otherwise. skyrl 0.3.0 declares
Python >= 3.11 but its pydantic models use `typing.TypedDict`, which pydantic
accepts only from 3.12: on 3.11 `typing.TypedDict` is pointed at
typing_extensions' before the import (the same class on 3.12).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import sys
import time
import typing

import pytest

if sys.version_info < (3, 12):
    import typing_extensions

    typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]

try:
    import skyrl_gym
    from skyrl.backends.skyrl_train.inference_servers.engine_utils import get_sampling_params_for_backend
    from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import RemoteInferenceClient
    from skyrl.backends.skyrl_train.weight_sync import WeightChunk, get_transfer_strategy_cls
    from skyrl.tinker import types as tinker
    from skyrl.train.config import GeneratorConfig, InferenceEngineConfig, SamplingParams, SkyRLGymConfig
    from skyrl.train.generators.skyrl_gym_generator import SkyRLGymGenerator
    from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
except Exception as e:
    pytest.skip(f"skyrl / skyrl_gym not importable ({type(e).__name__}: {e})", allow_module_level=True)

from bus import protocol as P
from bus.errors import Unsupported
from tests.test_skyrl_adapter import CHAT_TEMPLATE
from trainer_bridge import AsyncClient
from trainer_bridge.skyrl import RolloutBusEngine

TURNS = 3


class CountingEnv(BaseTextEnv):
    """Multi-turn: answers every model turn with an observation, done after TURNS."""

    def __init__(self, env_config=None, extras=None):
        super().__init__()
        self.max_turns = (extras or {}).get("max_turns", TURNS)

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        done = self.turns >= self.max_turns
        obs = [] if done else [{"role": "user", "content": "one two three"}]
        return BaseTextEnvStepOutput(observations=obs, reward=float(done), done=done, metadata={})


skyrl_gym.register(id="rollout_bus_counting", entry_point=CountingEnv)


@pytest.fixture(scope="module")
def tok(tiny_model):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tiny_model)
    t.chat_template = CHAT_TEMPLATE
    return t


def gen_cfg(max_len: int, *, batched: bool = False, turns: int = TURNS) -> GeneratorConfig:
    return GeneratorConfig(
        sampling_params=SamplingParams(max_generate_length=max_len, temperature=1.0, logprobs=1),
        max_turns=turns,
        max_input_length=2000,
        use_conversation_multi_turn=True,
        batched=batched,
        use_cache_salt=not batched,
    )


def batch_of(cfg: GeneratorConfig, n: int, **extra_sp) -> dict:
    sp = {**get_sampling_params_for_backend("vllm", cfg.sampling_params), **extra_sp}
    prompts = [[{"role": "user", "content": f"hello world {i}"}] for i in range(n)]
    return {
        "prompts": prompts,
        "env_classes": ["rollout_bus_counting"] * n,
        "env_extras": [{} for _ in range(n)],
        "sampling_params": sp,
    }


def run(coro, limit_s: float = 90):
    return asyncio.run(asyncio.wait_for(coro, limit_s))


def test_skyrl_gym_generator_runs_multi_turn_over_rollout_bus(torch_cluster, tok):
    cfg = gen_cfg(6)

    async def scenario():
        client = AsyncClient(torch_cluster.frontend, timeout_s=60, control_timeout_s=30)
        # SkyRL's config names the policy by its own path: that is the base model.
        engine = await RolloutBusEngine.connect(client, num_engines=2, tokenizer=tok)
        released: list[tuple[str, int]] = []  # (session id, live sessions at release time)
        salts: list[str | None] = []  # the cache_salt of every request the adapter sent
        finish = engine.finish_session

        async def recording_finish(session_id):
            released.append((session_id, (await client.stats())["sessions"]))
            await finish(session_id)

        engine.finish_session = recording_finish
        generate = client.generate

        async def recording_generate(ids, params=None, **kw):
            salts.append(params.cache_salt)
            return await generate(ids, params, **kw)

        client.generate = recording_generate  # what goes on the wire
        gen = SkyRLGymGenerator(cfg, SkyRLGymConfig(max_env_workers=0), engine, tok)
        # SkyRL's defaults (min_tokens=1 included) pass as they are; use_cache_salt
        # sends a cache_salt with every request.
        sessions_before = (await client.stats())["sessions"]
        out = await gen.generate(batch_of(cfg, 2), disable_tqdm=True)
        sessions_after = (await client.stats())["sessions"]
        await client.close()
        return out, sessions_before, sessions_after, released, salts, gen._compute_cache_salt()

    out, before, after, released, salts, salt = run(scenario())
    # use_cache_salt: SkyRL's salt (its policy's weight version) is on every request, as
    # vLLM's cache_salt; the vllm backend joins it with its own weight-version salt
    # (engine_node/backends/vllm/requests.prefix_salt, tests/test_vllm_backend_cpu.py).
    assert salt and len(salts) >= 2 and set(salts) == {salt}
    assert len({sid for sid, _ in released}) == 2 and all(live > before for _, live in released)
    assert len(out["response_ids"]) == 2 and out["rewards"] is not None
    for ids, mask, lps in zip(out["response_ids"], out["loss_masks"], out["rollout_logprobs"], strict=True):
        assert len(ids) == len(mask) == len(lps) and 0 < sum(mask) <= TURNS * (6 + 1)  # (+ an appended EOS per turn)
        assert 0 in mask  # observation tokens are masked out
    assert set(out["stop_reasons"]) <= {"stop", "length"}
    assert after == before  # every trajectory's session was released by finish_session


def test_skyrl_gym_generator_batched_and_model_name(torch_cluster, tok):
    cfg = gen_cfg(5, batched=True, turns=1)
    seen: list[dict] = []

    async def scenario():
        client = AsyncClient(torch_cluster.frontend, timeout_s=60, control_timeout_s=30)
        # The policy's path in SkyRL's config differs from the cluster's --model:
        # model_name= makes it the base model's name (issue 23: it became a LoRA
        # name; issue 35: a name the cluster does not serve is refused).
        engine = await RolloutBusEngine.connect(
            client, num_engines=2, tokenizer=tok, model_name="Qwen/Qwen2.5-0.5B-Instruct"
        )
        generate = engine.generate

        async def recording(input_batch, model=None):
            out = await generate(input_batch, model="Qwen/Qwen2.5-0.5B-Instruct")
            seen.append(out)
            return out

        engine.generate = recording
        gen = SkyRLGymGenerator(cfg, SkyRLGymConfig(max_env_workers=0), engine, tok)
        out = await gen.generate(batch_of(cfg, 3, stop=["w1"], include_stop_str_in_output=True), disable_tqdm=True)
        await client.close()
        return out

    out = run(scenario())
    assert len(out["response_ids"]) == 3
    (raw,) = seen  # one batched engine call
    for text, ids, why in zip(raw["responses"], raw["response_ids"], raw["stop_reasons"], strict=True):
        whole = tok.decode(ids, skip_special_tokens=True)
        # The text is the decoded ids (issue 23), cut after the stop string when it
        # ended on one: the occurrence its last token completed. An eos ends in "stop"
        # too, and SkyRL's min_tokens=1 leaves a "w1" in the first token unchecked.
        last = tok.decode(ids[-1:], skip_special_tokens=True)
        on_stop_str = why == "stop" and ids[-1] != tok.eos_token_id and "w1" in whole[-len(last) - 1 :]
        want = whole[: whole.index("w1", max(0, len(whole) - len(last) - 1)) + 2] if on_stop_str else whole
        assert text == want, (why, text, whole, ids)


def test_tinker_sample_request_and_aclose(torch_cluster, tok):
    # The request SkyRL's Tinker backend (SkyRLTrainBackend._sample_with_remote_client)
    # sends: model, prompt (ModelInput.model_dump()), num_samples, sampling_params
    # (Tinker's SamplingParams.model_dump()), session_id; then aclose().
    mi = tinker.ModelInput(chunks=[tinker.EncodedTextChunk(tokens=[5, 17, 42, 9])])
    sp = tinker.SamplingParams(temperature=1.0, max_tokens=7, seed=3)

    async def scenario():
        engine = await RolloutBusEngine.connect(torch_cluster.frontend, num_engines=2, tokenizer=tok)
        body = {
            "model": engine.model_name,
            "prompt": mi.model_dump(),
            "num_samples": 2,
            "sampling_params": sp.model_dump(),
        }
        outs = await asyncio.gather(
            engine.sample({"json": {**body, "session_id": "tinker-1"}}),
            engine.sample({"json": {**body, "include_prompt_logprobs": True, "topk_prompt_logprobs": 2}}),
            return_exceptions=True,
        )
        await engine.aclose()
        again = await engine.sample({"json": body})  # the next batch reopens the connection
        await engine.finish_session("tinker-1")
        await engine.aclose()
        return outs, again

    outs, again = run(scenario())
    for out in [*outs, again]:
        assert not isinstance(out, Exception), out
        assert out["type"] == "sample" and len(out["sequences"]) == 2
        for seq in out["sequences"]:
            assert len(seq["tokens"]) == len(seq["logprobs"]) <= 7 and seq["stop_reason"] in ("stop", "length")
    assert outs[0]["prompt_logprobs"] is None
    plp, top = outs[1]["prompt_logprobs"], outs[1]["topk_prompt_logprobs"]
    assert len(plp) == 4 and plp[0] is None and all(x < 0 for x in plp[1:])
    assert top[0] is None and all(len(t) == 2 and t[0][1] >= t[1][1] for t in top[1:])
    assert outs[0]["sequences"] == again["sequences"]  # same seed, same samples


def _new_weights(tiny_model, scale: float) -> list:
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    named = [
        (n, (p.detach() + scale * torch.randn(p.shape, generator=g)).contiguous()) for n, p in m.named_parameters()
    ]
    half = len(named) // 2  # two chunks, as SkyRL's extractor groups them
    return [
        WeightChunk(
            names=[n for n, _ in part],
            dtypes=[str(t.dtype) for _, t in part],
            shapes=[list(t.shape) for _, t in part],
            tensors=[t for _, t in part],
        )
        for part in (named[:half], named[half:])
    ]


@pytest.fixture
def skyrl_rank0(monkeypatch):
    """SkyRL's senders run on a torch.distributed rank (gloo, world size 1 here)
    and ask torch.cuda for the current device and its uuid: pointed at the CPU."""
    import socket
    import types

    import torch
    import torch.distributed as dist

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _d: types.SimpleNamespace(uuid="cpu"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *_a, **_k: None)
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda *_a, **_k: None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_skyrl_default_nccl_backend_on_cpu_is_a_typed_error(torch_cluster, tok):
    ie = InferenceEngineConfig(model_dtype="float32")  # SkyRL's default weight_sync_backend="nccl"
    strategy = get_transfer_strategy_cls(ie.weight_sync_backend, colocate_all=True)
    info = strategy.create_init_info(ie, inference_world_size=2)

    async def scenario():
        engine = await RolloutBusEngine.connect(torch_cluster.frontend, num_engines=2, tokenizer=tok)
        try:
            # SkyRL's Worker.init_weight_sync_state, rank 0 (its worker module needs
            # jaxtyping and ray, so its two calls are made here in its order): the
            # sender is made in a thread while the engine sets up its receivers.
            await asyncio.gather(
                asyncio.to_thread(strategy.create_sender, init_info=info, inference_client=engine),
                engine.init_weight_update_communicator(info),
            )
        finally:
            await engine.aclose()

    with pytest.raises(Unsupported) as e:  # not torch's "Found no NVIDIA driver"
        run(scenario())
    assert e.value.field == "weight_sync_backend" and "no CUDA device" in str(e.value)
    assert "weight_sync_backend to anything but 'nccl'" in str(e.value)


def test_skyrl_broadcast_strategy_with_torch_engines_is_a_typed_error(torch_cluster, tok, monkeypatch):
    """SkyRL's non-colocated strategy on a trainer WITH CUDA (faked) but
    engines on the torch backend: refused naming weight_sync_backend and the
    engines, before any group is made or any op reaches the engines."""
    import trainer_bridge.skyrl.engine as S  # has_cuda is looked up there

    monkeypatch.setattr(S, "has_cuda", lambda: True)
    ie = InferenceEngineConfig(model_dtype="float32", weight_sync_backend="nccl")
    strategy = get_transfer_strategy_cls(ie.weight_sync_backend, colocate_all=False)  # BroadcastTransferStrategy
    info = strategy.create_init_info(ie, inference_world_size=2)

    async def scenario():
        engine = await RolloutBusEngine.connect(torch_cluster.frontend, num_engines=2, tokenizer=tok)
        try:
            v0 = (await engine.client.health())["weight_version"]
            with pytest.raises(Unsupported) as e:
                await engine.init_weight_update_communicator(info)
            return e.value, v0, (await engine.client.health())["weight_version"]
        finally:
            await engine.aclose()

    err, v0, v1 = run(scenario())
    assert err.field == "weight_sync_backend" and "torch" in str(err) and "vllm backend" in str(err)
    assert v1 == v0


def test_skyrl_ipc_strategy_syncs_weights_with_rollouts_in_flight(torch_cluster, tok, tiny_model, skyrl_rank0):
    ie = InferenceEngineConfig(model_dtype="float32", weight_sync_backend="nccl")
    strategy = get_transfer_strategy_cls(ie.weight_sync_backend, colocate_all=True)  # CudaIpcTransferStrategy
    chunks = _new_weights(tiny_model, 0.01)
    n_tok = 600

    async def scenario():
        client = AsyncClient(torch_cluster.frontend, timeout_s=120, control_timeout_s=60)
        engine = await RolloutBusEngine.connect(client, num_engines=2, tokenizer=tok)
        sender = strategy.create_sender(strategy.create_init_info(ie), engine)
        v0 = (await client.health())["weight_version"]
        sp = {"max_tokens": n_tok, "ignore_eos": True, "temperature": 1.0}
        flying = [asyncio.create_task(client.generate([5 + i, 17, 42], sp)) for i in range(4)]
        while sum(e["tokens_out"] for e in (await client.health())["engines"].values()) == 0:
            await asyncio.sleep(0.02)
        await sender.send_chunks(chunks)  # SkyRL's own sender, unmodified
        engine.increment_weight_version()
        results = await asyncio.gather(*flying)
        v1 = (await client.health())["weight_version"]
        await client.close()
        return v0, v1, results

    v0, v1, results = run(scenario(), 120)
    assert v1 == v0 + 1  # one update for the two chunks
    for r in results:
        s = r.samples[0]
        assert len(s.token_ids) == n_tok and s.finish_reason == "length"  # every rollout at full length
        assert set(s.token_versions) <= {v0, v1}
    assert any(set(r.samples[0].token_versions) == {v0, v1} for r in results)  # tokens from both versions


def test_cancelled_trajectories_stop_on_the_engines(torch_cluster, tok):
    """8 multi-turn trajectories; the task awaiting SkyRL's generator is
    cancelled mid-generation: every request is cancelled on its engine."""
    cfg = gen_cfg(1500)

    async def scenario():
        client = AsyncClient(torch_cluster.frontend, timeout_s=120, control_timeout_s=30)
        try:
            return await cancel_and_watch(client)
        finally:
            await client.close()

    async def cancel_and_watch(client):
        engine = await RolloutBusEngine.connect(client, num_engines=2, tokenizer=tok)
        gen = SkyRLGymGenerator(cfg, SkyRLGymConfig(max_env_workers=0), engine, tok)
        before = asyncio.all_tasks()
        task = asyncio.create_task(gen.generate(batch_of(cfg, 8, ignore_eos=True), disable_tqdm=True))

        deadline = time.monotonic() + 30
        while await running(client) < 8:
            assert time.monotonic() < deadline, "the 8 trajectories never ran"
            await asyncio.sleep(0.05)
        # SkyRL gathers its agent loops with tqdm.asyncio's gather (as_completed):
        # cancelling generate()'s task leaves them running, so cancel them all,
        # as the issue did (the generator's task and its agent-loop tasks).
        spawned = asyncio.all_tasks() - before - {asyncio.current_task()}
        assert task in spawned and len(spawned) >= 9
        for t in spawned:
            t.cancel()
        t0 = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.gather(*spawned, return_exceptions=True)
        while await running(client):
            assert time.monotonic() - t0 < 5.0, "engines still generating 5 s after the cancel"
        idle_after = time.monotonic() - t0
        out0 = await tokens_out(client)
        await asyncio.sleep(1.0)
        return idle_after, out0, await tokens_out(client)

    idle_after, out0, out1 = run(scenario(), 90)
    print(f"engines idle {idle_after:.2f} s after the cancel")
    assert idle_after < 0.5  # issue 23's target, read from the engines themselves (running())
    assert out1 == out0  # nothing generated for anyone since


async def running(client: AsyncClient) -> int:
    """Sequences in the engines now: each engine's own count (a Stats op
    answers with a fresh heartbeat), not the head's view, which lags by up
    to a heartbeat interval (0.5 s)."""
    return sum(r["running"] + r["waiting"] for r in (await client.control(P.Stats())).values())


async def tokens_out(client: AsyncClient) -> int:
    return sum(r["tokens_out"] for r in (await client.control(P.Stats())).values())


# Last in the module: on failure the engines are woken and resumed for the next module.
def test_colocated_sleep_wake_sync_order(torch_cluster, tok, tiny_model, skyrl_rank0):
    """SkyRL's colocated loop: sleep (level 2) → wake_up(["weights"]) → sync →
    wake_up(["kv_cache"]) → generate."""
    ie = InferenceEngineConfig(model_dtype="float32", weight_sync_backend="nccl")
    strategy = get_transfer_strategy_cls(ie.weight_sync_backend, colocate_all=True)
    chunks = _new_weights(tiny_model, 0.02)

    async def scenario():
        client = AsyncClient(torch_cluster.frontend, timeout_s=8, control_timeout_s=8)
        engine = await RolloutBusEngine.connect(client, num_engines=2, tokenizer=tok)
        try:
            v0 = (await client.health())["weight_version"]
            await engine.sleep()  # SkyRL's trainer calls it without a level: its client's default, 2
            levels = {e["sleeping"] for e in (await client.health())["engines"].values()}
            await engine.wake_up(tags=["weights"])
            await strategy.create_sender(strategy.create_init_info(ie), engine).send_chunks(chunks)
            await engine.wake_up(tags=["kv_cache"])
            out = await engine.generate({"prompt_token_ids": [[5, 17, 42]], "sampling_params": {"max_tokens": 4}})
            return v0, (await client.health())["weight_version"], out, levels
        finally:
            for undo in (client.wake_up, client.resume):  # whatever happened, leave the engines serving
                with contextlib.suppress(Exception):
                    await undo()
            await client.close()

    v0, v1, out, levels = run(scenario(), 60)
    assert v1 == v0 + 1 and len(out["response_ids"][0]) == 4
    skyrl_default = inspect.signature(RemoteInferenceClient.sleep).parameters["level"].default
    assert levels == {skyrl_default} == {2}
