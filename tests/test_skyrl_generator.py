"""SkyRL's own `SkyRLGymGenerator` driving rollout-bus through
`trainer_bridge.skyrl.RolloutBusEngine`: multi-turn trajectories (session ids,
finish_session), SkyRL's sampling params, its chat templating and loss masks.

Runs only where `skyrl` and `skyrl_gym` import (skyrl needs Python >= 3.12 and
a multi-GB torch), so it stays out of CI: skipped with the reason otherwise.
"""

from __future__ import annotations

import asyncio

import pytest

try:
    import skyrl_gym
    from skyrl.backends.skyrl_train.inference_servers.engine_utils import get_sampling_params_for_backend
    from skyrl.train.config import GeneratorConfig, SamplingParams, SkyRLGymConfig
    from skyrl.train.generators.skyrl_gym_generator import SkyRLGymGenerator
    from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
except Exception as e:
    pytest.skip(f"skyrl / skyrl_gym not importable ({type(e).__name__}: {e})", allow_module_level=True)

from tests.test_skyrl_adapter import CHAT_TEMPLATE
from trainer_bridge import AsyncClient
from trainer_bridge.skyrl import RolloutBusEngine

TURNS = 3


class CountingEnv(BaseTextEnv):
    """Multi-turn: answers every model turn with an observation, done after TURNS."""

    def __init__(self, env_config=None, extras=None):
        super().__init__()
        self.max_turns = TURNS

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        done = self.turns >= TURNS
        obs = [] if done else [{"role": "user", "content": "one two three"}]
        return BaseTextEnvStepOutput(observations=obs, reward=float(done), done=done, metadata={})


skyrl_gym.register(id="rollout_bus_counting", entry_point=CountingEnv)


def test_skyrl_gym_generator_runs_multi_turn_over_rollout_bus(torch_cluster, tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = CHAT_TEMPLATE
    cfg = GeneratorConfig(
        sampling_params=SamplingParams(max_generate_length=6, temperature=1.0, logprobs=1),
        max_turns=TURNS,
        max_input_length=1024,
        use_conversation_multi_turn=True,
        batched=False,
        use_cache_salt=False,
    )
    sp = get_sampling_params_for_backend("vllm", cfg.sampling_params)
    prompts = [[{"role": "user", "content": "hello world"}], [{"role": "user", "content": "the quick brown fox"}]]

    async def scenario():
        client = AsyncClient(torch_cluster.frontend, timeout_s=60, control_timeout_s=30)
        engine = await RolloutBusEngine.connect(client, num_engines=2, tokenizer=tok)
        released: list[tuple[str, int]] = []  # (session id, live sessions at release time)
        finish = engine.finish_session

        async def recording_finish(session_id):
            released.append((session_id, (await client.stats())["sessions"]))
            await finish(session_id)

        engine.finish_session = recording_finish
        gen = SkyRLGymGenerator(cfg, SkyRLGymConfig(max_env_workers=0), engine, tok)
        batch = {
            "prompts": prompts,
            "env_classes": ["rollout_bus_counting"] * 2,
            "env_extras": [{}, {}],
            "sampling_params": sp,
        }
        # SkyRL's defaults (min_tokens=1 included) pass as they are.
        sessions_before = (await client.stats())["sessions"]
        out = await gen.generate(batch, disable_tqdm=True)
        sessions_after = (await client.stats())["sessions"]
        await client.close()
        return out, sessions_before, sessions_after, released

    out, before, after, released = asyncio.run(asyncio.wait_for(scenario(), 90))
    assert len({sid for sid, _ in released}) == 2 and all(live > before for _, live in released)
    assert len(out["response_ids"]) == 2 and out["rewards"] is not None
    for ids, mask, lps in zip(out["response_ids"], out["loss_masks"], out["rollout_logprobs"], strict=True):
        assert len(ids) == len(mask) == len(lps) and 0 < sum(mask) <= TURNS * (6 + 1)  # (+ an appended EOS per turn)
        assert 0 in mask  # observation tokens are masked out
    assert set(out["stop_reasons"]) <= {"stop", "length"}
    assert after == before  # every trajectory's session was released by finish_session
