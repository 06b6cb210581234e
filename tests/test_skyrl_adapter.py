"""Contract test of `trainer_bridge.skyrl.RolloutBusEngine`, written from
SkyRL's `InferenceEngineInterface` (skyrl 0.3.0 `inference_servers/base.py`
and 0.2.0 `inference_engines/base.py`), against real torch engines. No skyrl
import needed; tests/test_skyrl_generator.py drives SkyRL's own generator."""

from __future__ import annotations

import asyncio
import inspect
import os
import pickle

import pytest

from bus.errors import BadRequest, ClosedByUs, Unsupported
from trainer_bridge import AsyncClient
from trainer_bridge.sampling import PARAMS, needs_server, translate
from trainer_bridge.skyrl import RolloutBusEngine

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}assistant{% endif %}"
)

# Every method of both interface versions: name → (is coroutine, is property).
INTERFACE = {
    "model_name": (False, True), "generate": (True, False), "sample": (True, False),
    "get_endpoint_url": (False, False), "chat_completion": (True, False), "render_chat_completion": (True, False),
    "completion": (True, False), "wake_up": (True, False), "sleep": (True, False),
    "init_weight_update_communicator": (True, False), "update_named_weights": (True, False), "teardown": (True, False),
    "reset_prefix_cache": (True, False), "pause_generation": (True, False), "resume_generation": (True, False),
    "abort_generation": (True, False), "finish_session": (True, False), "get_world_size": (True, False),
    "tp_size": (False, False), "pp_size": (False, False), "dp_size": (False, False),
}  # fmt: skip

# What skyrl's get_sampling_params_for_backend("vllm", SamplingParams()) returns
# (skyrl 0.3.0 engine_utils.get_vllm_sampling_params, defaults of config.SamplingParams),
# max_generate_length lowered for the test. The DictConfig path adds repetition_penalty.
SKYRL_DEFAULT_PARAMS = {
    "min_tokens": 1, "skip_special_tokens": True, "include_stop_str_in_output": True, "max_tokens": 8,
    "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "logprobs": 1, "stop": None,
}  # fmt: skip


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def engine(torch_cluster, tiny_model, loop):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = CHAT_TEMPLATE
    client = AsyncClient(torch_cluster.frontend, timeout_s=60, control_timeout_s=30)
    eng = loop.run_until_complete(RolloutBusEngine.connect(client, num_engines=2, tokenizer=tok))
    yield eng
    loop.run_until_complete(client.close())


def run(loop, coro):
    return loop.run_until_complete(asyncio.wait_for(coro, 60))


def params(**kw):
    # SkyRL's defaults, as they are (min_tokens=1 included)
    return {**SKYRL_DEFAULT_PARAMS, "ignore_eos": True, **kw}


# ------------------------------------------------------------------ interface


def test_every_interface_method_exists_with_its_kind():
    for name, (is_coro, is_prop) in INTERFACE.items():
        attr = inspect.getattr_static(RolloutBusEngine, name)
        assert isinstance(attr, property) == is_prop, name
        if not is_prop:
            assert inspect.iscoroutinefunction(attr) == is_coro, name
    from trainer_bridge.skyrl import InferenceEngineBase

    if InferenceEngineBase is object:
        # structural typing only: skyrl was not importable when the adapter
        # loaded (not installed, or Python 3.11 before tests/test_skyrl_generator
        # patches typing.TypedDict for skyrl's pydantic models)
        return
    from skyrl.backends.skyrl_train.inference_servers.base import InferenceEngineInterface

    assert issubclass(RolloutBusEngine, InferenceEngineInterface)
    assert not RolloutBusEngine.__abstractmethods__


# ------------------------------------------------------------------ sampling params


def test_skyrl_default_params_translate():
    tr = translate({**SKYRL_DEFAULT_PARAMS, "repetition_penalty": 1.0, "n": 2}, prefix="sampling_params.")
    assert (tr.params.top_k, tr.params.logprobs, tr.params.max_tokens, tr.num_samples, tr.skip_special_tokens) == (
        0,
        1,
        8,
        2,
        True,
    )
    assert (tr.params.min_tokens, tr.params.include_stop_str_in_output, tr.params.stop) == (1, True, [])


# Values trainers send that the engines honour since issue 10's server side: each
# goes onto the wire as it is.
ISSUE10 = {
    "stop": ["</s>"], "include_stop_str_in_output": True, "min_tokens": 2, "min_p": 0.05,
    "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.5, "prompt_logprobs": 1, "logprobs": 5,
    "skip_special_tokens": False,
}  # fmt: skip


@pytest.mark.parametrize("key", sorted(ISSUE10))
def test_issue10_params_go_onto_the_wire(key):
    tr = translate({"max_tokens": 4, key: ISSUE10[key]}, prefix="sampling_params.")
    assert getattr(tr.params, key) == ISSUE10[key]


def test_bad_values_are_typed_errors_naming_the_field():
    for key, v in (("stop", [1]), ("min_tokens", 1.5), ("prompt_logprobs", "x"), ("min_p", "x")):
        with pytest.raises(BadRequest) as e:
            translate({"max_tokens": 4, key: v}, prefix="sampling_params.")
        assert e.value.field == f"sampling_params.{key}"
    assert translate({"stop": "END"}).params.stop == ["END"]  # vLLM: one string or a list


def test_param_table_covers_the_issue_and_unknown_keys_stay_errors():
    assert needs_server() == []
    for key in ("stop_token_ids", "seed", "n", "skip_special_tokens", "top_k", "logprobs"):
        assert key in PARAMS
    with pytest.raises(BadRequest) as e:
        translate({"guided_json": {}}, prefix="sampling_params.")
    assert e.value.field == "sampling_params.guided_json" and not isinstance(e.value, Unsupported)
    with pytest.raises(BadRequest) as e:
        translate({"max_tokens": "many"})
    assert e.value.field == "max_tokens"


# ------------------------------------------------------------------ generation


def test_generate_token_ids(engine, loop):
    prompts = [[5, 17, 42, 9], [100, 3, 77]]
    out = run(loop, engine.generate({"prompt_token_ids": prompts, "sampling_params": params(), "session_ids": None}))
    assert [len(r) for r in out["response_ids"]] == [8, 8] and out["stop_reasons"] == ["length", "length"]
    assert [len(lp) for lp in out["response_logprobs"]] == [8, 8]
    tok = engine._text.tokenizer
    assert out["responses"] == [tok.decode(r, skip_special_tokens=True) for r in out["response_ids"]]
    assert out["prompt_logprobs"] is None
    raw = run(
        loop, engine.generate({"prompt_token_ids": prompts, "sampling_params": params(skip_special_tokens=False)})
    )
    assert raw["responses"] == [tok.decode(r, skip_special_tokens=False) for r in raw["response_ids"]]
    n2 = run(loop, engine.generate({"prompt_token_ids": prompts, "sampling_params": params(n=2, logprobs=None)}))
    assert len(n2["response_ids"]) == 4 and n2["response_logprobs"] is None  # n samples per prompt, prompt-major
    with pytest.raises(BadRequest) as e:  # refused by the engine, naming the field
        run(loop, engine.generate({"prompt_token_ids": prompts, "sampling_params": params(min_p=1.5)}))
    assert e.value.field == "params.min_p"


def test_generate_prompt_logprobs_and_stop_strings(engine, loop):
    prompts = [[5, 17, 42, 9]]
    out = run(
        loop,
        engine.generate({"prompt_token_ids": prompts, "sampling_params": params(prompt_logprobs=0, temperature=0.0)}),
    )
    plp = out["prompt_logprobs"][0]
    assert len(plp) == 4 and plp[0] is None and all(x < 0 for x in plp[1:])
    tok = engine._text.tokenizer
    from engine_node.detokenize import StopMatcher

    # the engine's text is vLLM's incremental detokenization after the prompt
    # (here: a leading space that a whole-output decode does not have)
    full = StopMatcher(tok, prompts[0], [], prior=out["response_ids"][0]).text
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    for include in (True, False):
        sp = params(temperature=0.0, stop=[stop], include_stop_str_in_output=include)
        got = run(loop, engine.generate({"prompt_token_ids": prompts, "sampling_params": sp}))
        assert got["stop_reasons"] == ["stop"]
        ids = got["response_ids"][0]
        # issue 23: the text is the decoded ids (no leading space from the
        # engine's incremental text), cut at the stop string as asked
        whole = tok.decode(ids, skip_special_tokens=True)
        cut = whole.index(stop) + (len(stop) if include else 0)
        assert got["responses"][0] == whole[:cut] and whole.startswith(got["responses"][0])
        assert got["responses"][0].endswith(stop) == include
        assert ids == out["response_ids"][0][: len(ids)]  # tokens up to the one completing the stop string
        assert stop in tok.decode(ids) and stop not in tok.decode(ids[:-1])


def test_generate_chat_prompts_equal_their_template_ids(engine, loop):
    chats = [[{"role": "user", "content": "hello world"}], [{"role": "user", "content": "one two"}]]
    greedy = params(temperature=0.0)
    by_chat = run(loop, engine.generate({"prompts": chats, "sampling_params": greedy}))
    ids = [engine._text.chat(c) for c in chats]
    by_ids = run(loop, engine.generate({"prompt_token_ids": ids, "sampling_params": greedy}))
    assert by_chat["response_ids"] == by_ids["response_ids"]
    rendered = run(loop, engine.render_chat_completion({"json": {"messages": chats[0]}}))
    assert rendered["token_ids"] == ids[0]


def test_sample_tinker_semantics(engine, loop):
    out = run(loop, engine.sample([5, 17, 42], 3, params(seed=11, logprobs=None)))
    assert len(out["response_ids"]) == 3 and set(out["stop_reasons"]) <= {"stop", "length"}
    assert [len(x) for x in out["response_logprobs"]] == [len(r) for r in out["response_ids"]]  # always, as Tinker
    assert len({tuple(r) for r in out["response_ids"]}) > 1  # independent samples
    assert out == run(loop, engine.sample([5, 17, 42], 3, params(seed=11, logprobs=None)))  # seeded: reproducible
    assert len(run(loop, engine.sample([5, 17, 42], 2, params(n=2)))["response_ids"]) == 2
    with pytest.raises(BadRequest) as e:  # the client's rule (sampling.for_request): n and num_samples agree
        run(loop, engine.sample([5, 17, 42], 2, params(n=3)))
    assert e.value.field == "sampling_params.n"


def test_tinker_sample_leaves_no_session_on_the_head(engine, loop):
    """Issue 35: SkyRL's Tinker path sends its sampling session's id with every
    sample and never ends it: each became a head session, kept for
    session_ttl_s. The head's session count is back where it was."""

    async def sessions():
        return (await engine.client.stats())["sessions"]

    before = run(loop, sessions())
    body = {"model": engine.model_name, "prompt": {"chunks": [{"tokens": [5, 17, 42]}]}, "num_samples": 2}
    for sid in ("tinker-session-1", "tinker-session-2", None):
        out = run(loop, engine.sample({"json": {**body, "session_id": sid} if sid else body}))
        assert out["type"] == "sample" and len(out["sequences"]) == 2
    assert run(loop, sessions()) == before


def test_multi_turn_with_session_ids_stays_and_is_released(engine, loop):
    async def stats():
        return (await engine.client.stats())["sessions"]

    before = run(loop, stats())
    ids = [5, 17, 42]
    for _ in range(3):  # token-in/token-out: append the response and an observation
        out = run(
            loop, engine.generate({"prompt_token_ids": [ids], "session_ids": ["traj-7"], "sampling_params": params()})
        )
        ids = ids + out["response_ids"][0] + [9, 9]
    assert run(loop, stats()) == before + 1
    run(loop, engine.finish_session("traj-7"))
    assert run(loop, stats()) == before
    run(loop, engine.finish_session("never-opened"))  # best effort, never raises


def test_openai_shaped_chat_completion_and_completion(engine, loop):
    body = {"model": engine.model_name, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5,
            "temperature": 0.0, "logprobs": True, "ignore_eos": True, "session_id": "chat-1"}  # fmt: skip
    r = run(loop, engine.chat_completion({"json": body}))
    assert r["object"] == "chat.completion" and r["choices"][0]["message"]["role"] == "assistant"
    ch = r["choices"][0]
    assert len(ch["token_ids"]) == 5 and ch["finish_reason"] == "length" and len(ch["logprobs"]["content"]) == 5
    assert ch["message"]["content"] == engine._text.decode(ch["token_ids"])
    assert r["usage"]["completion_tokens"] == 5
    c = run(
        loop,
        engine.completion(
            {"json": {"prompt": ["hello world", [5, 17]], "max_tokens": 4, "ignore_eos": True, "logprobs": 1}}
        ),
    )
    assert c["object"] == "text_completion" and [len(x["token_ids"]) for x in c["choices"]] == [4, 4]
    assert len(c["choices"][0]["logprobs"]["token_logprobs"]) == 4
    with pytest.raises(Unsupported) as e:
        run(loop, engine.chat_completion({"json": {**body, "stream": True}}))
    assert e.value.field == "stream"
    # issue 23: no max_tokens → up to the context limit, as vLLM's server (max_model_len - prompt)
    limit = min(e["max_model_len"] for e in engine._engines)
    assert limit > 8
    long = [5 + i % 50 for i in range(limit - 6)]
    c = run(loop, engine.completion({"json": {"prompt": long, "ignore_eos": True}}))
    assert [len(x["token_ids"]) for x in c["choices"]] == [6] and c["choices"][0]["finish_reason"] == "length"
    with pytest.raises(BadRequest) as e:
        run(loop, engine.completion({"json": {"prompt": long + [5] * 6}}))
    assert e.value.field == "prompt"
    # the same for chat: its templated prompt (max_model_len - prompt ids), as vLLM's server
    words = ["one"]
    while len(engine._text.chat([{"role": "user", "content": " ".join(words)}])) < limit - 6:
        words.append("one")
    msgs = [{"role": "user", "content": " ".join(words)}]
    left = limit - len(engine._text.chat(msgs))
    r = run(loop, engine.chat_completion({"json": {"messages": msgs, "ignore_eos": True}}))
    assert 0 < left <= 6 and len(r["choices"][0]["token_ids"]) == left and r["choices"][0]["finish_reason"] == "length"
    run(loop, engine.finish_session("chat-1"))


# ------------------------------------------------------------------ control plane


def test_topology_and_identity(engine, loop, tiny_model):
    assert (engine.tp_size(), engine.pp_size(), engine.dp_size()) == (1, 1, 2)
    assert run(loop, engine.get_world_size()) == (2, 1)
    assert engine.model_name == tiny_model
    with pytest.raises(Unsupported) as e:  # no HTTP endpoint: a tcp:// address would fail inside an HTTP client
        engine.get_endpoint_url()
    assert e.value.field == "endpoint_url"
    assert RolloutBusEngine(engine.client, endpoint_url="http://proxy:8000").get_endpoint_url() == "http://proxy:8000"


def test_model_means_the_base_model_or_a_loaded_lora_else_refused(engine, loop, tiny_model, tmp_path):
    """Issue 23: SkyRL passes its policy's path as `model=` on every call; it
    became a LoRA name and every request failed. The base model's names (its
    --model path, folder name) serve it; SkyRL's LoraLoadRequest loads an
    adapter, and its name then routes to it. Issue 35: any other name is
    refused, listing what is served, instead of being answered by the base model."""
    from types import SimpleNamespace

    from engine_node.tiny_model import make_random_lora

    path = make_random_lora(tiny_model, str(tmp_path / "adapter"), seed=1)
    batch = {"prompt_token_ids": [[11, 12, 13]], "sampling_params": params(temperature=0.0, max_tokens=12)}
    base = run(loop, engine.generate(batch))["response_ids"]
    assert run(loop, engine.generate(batch, model=tiny_model))["response_ids"] == base
    assert run(loop, engine.generate(batch, model=os.path.basename(tiny_model)))["response_ids"] == base
    for wrong in ("Qwen/Qwen2.5-0.5B-Instruct", "skyrl-lora"):  # not served; the adapter not loaded yet
        with pytest.raises(BadRequest) as e:
            run(loop, engine.generate(batch, model=wrong))
        assert e.value.field == "model" and repr(tiny_model) in e.value.message, e.value.message
    run(loop, engine.update_named_weights(SimpleNamespace(lora_name="skyrl-lora", lora_path=path)))
    try:
        assert run(loop, engine.generate(batch, model="skyrl-lora"))["response_ids"] != base  # the adapter's tokens
        assert run(loop, engine.generate(batch, model=tiny_model))["response_ids"] == base
        for unsaid in (None, ""):  # with an adapter loaded a call must say which model (as SkyRL's own client)
            with pytest.raises(BadRequest) as e:
                run(loop, engine.generate(batch, model=unsaid))
            assert e.value.field == "model" and "skyrl-lora" in e.value.message
        with pytest.raises(BadRequest) as e:
            run(loop, engine.sample({"json": {"model": "Qwen/x", "prompt": {"chunks": [{"tokens": [5, 6]}]}}}))
        assert "skyrl-lora" in e.value.message and e.value.field == "model"
    finally:
        run(loop, engine.client.unload_lora("skyrl-lora"))
        run(loop, engine.refresh())


def test_sleep_wake_reset_and_pause_resume(engine, loop):
    run(loop, engine.sleep(level=1))
    run(loop, engine.wake_up())
    run(loop, engine.reset_prefix_cache())
    run(loop, engine.pause_generation())
    assert run(loop, engine.client.is_paused())
    run(loop, engine.resume_generation())
    assert not run(loop, engine.client.is_paused())
    out = run(loop, engine.generate({"prompt_token_ids": [[5, 6]], "sampling_params": params(max_tokens=3)}))
    assert len(out["response_ids"][0]) == 3


def test_pause_keep_and_abort_with_weight_updates_mid_run(engine, loop, tiny_model):
    """A batch in flight through pause(keep) + update + resume, then
    abort_generation + update + resume: every response has exactly max_tokens
    tokens, no "abort" stop reason, and the later tokens carry new weights."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    prompts = [[5, 17, 42, 9], [100, 3, 77], [8, 8, 8], [250, 1]]
    n = 400  # long enough that both pauses land mid-run (heartbeats, which the poll reads, lag by 0.2 s)

    async def scenario():
        task = asyncio.ensure_future(
            engine.generate({"prompt_token_ids": prompts, "sampling_params": params(max_tokens=n)})
        )

        async def running() -> bool:
            return sum(e["running"] for e in await engine.client.engines()) > 0 and not task.done()

        for _ in range(200):
            if await running():
                break
            await asyncio.sleep(0.02)
        res = await engine.pause_generation()
        assert sum(r["frozen"] for r in res.values()) > 0 and not task.done()
        await engine.init_weight_update_communicator(object())  # no SkyRL init info: the zmq transport
        await engine.update_named_weights({k: v.clone() for k, v in model.named_parameters()})
        await engine.resume_generation()
        res = await engine.abort_generation()
        assert not task.done()
        await engine.update_named_weights(list(model.named_parameters()))
        await engine.resume_generation()
        return await task, res

    out, abort_res = run(loop, scenario())
    assert sum(r["parked"] for r in abort_res.values()) > 0  # the abort landed mid-run
    assert out["stop_reasons"] == ["length"] * 4  # nobody sees "abort"
    assert [len(r) for r in out["response_ids"]] == [n] * 4 and [len(x) for x in out["response_logprobs"]] == [n] * 4
    versions = {e["weight_version"] for e in run(loop, engine.client.engines())}
    assert len(versions) == 1 and min(versions) >= 2


def test_update_named_weights_refuses_metadata_only_requests(engine, loop):
    class BroadcastWeightUpdateRequest:  # SkyRL's shape: names/dtypes/shapes, bytes elsewhere
        names, dtypes, shapes = ["w"], ["float32"], [[2]]

    with pytest.raises(Unsupported) as e:
        run(loop, engine.update_named_weights(BroadcastWeightUpdateRequest()))
    assert e.value.field == "request"


def test_teardown_closes_an_owned_client(torch_cluster, loop):
    eng = RolloutBusEngine(torch_cluster.frontend)
    run(loop, eng.refresh())
    first = eng.client
    run(loop, eng.teardown())
    assert first._closed and first._sock is None or first._sock.closed
    with pytest.raises(ClosedByUs):
        run(loop, first.engines())
    # SkyRL's Tinker path calls aclose() after every batch and samples again
    # on the next: an owned client reopens
    assert run(loop, eng.refresh()) and eng.client is not first
    run(loop, eng.aclose())
    assert eng._client._closed


def test_owned_client_survives_new_event_loops_and_pickling(torch_cluster, tiny_model):
    # SkyRL runs `asyncio.run` more than once and hands its client to Ray workers (pickled).
    eng = RolloutBusEngine(torch_cluster.frontend, tokenizer=tiny_model)
    batch = {"prompt_token_ids": [[5, 6]], "sampling_params": {"max_tokens": 3, "ignore_eos": True}}
    assert len(asyncio.run(eng.generate(batch))["response_ids"][0]) == 3
    assert len(asyncio.run(eng.generate(batch))["response_ids"][0]) == 3  # a new loop: a fresh connection
    copy = pickle.loads(pickle.dumps(eng))
    assert len(asyncio.run(copy.generate(batch))["response_ids"][0]) == 3
    eng.increment_weight_version()
    assert (eng.weight_version, copy.weight_version) == (1, 0)
    for e in (eng, copy):
        asyncio.run(e.teardown())


def test_skyrl_weight_sync_strategy_sends_chunks(engine, loop, tiny_model):
    import types

    import torch
    from transformers import AutoModelForCausalLM

    from trainer_bridge.skyrl.weights import get_transfer_strategy_cls

    strategy = get_transfer_strategy_cls("nccl", colocate_all=False)
    assert strategy.create_init_info(types.SimpleNamespace(weight_sync_backend="nccl")).transport == "nccl"
    assert (
        get_transfer_strategy_cls("nccl", True)
        .create_init_info(types.SimpleNamespace(weight_sync_backend="nccl"))
        .transport
        == "cuda_ipc"
    )
    info = strategy.create_init_info(types.SimpleNamespace(weight_sync_backend="gloo"), inference_world_size=2)
    assert info.transport == "zmq"  # CPU engines here
    sender = strategy.create_sender(info, engine)
    params = list(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).named_parameters())
    chunks = [
        types.SimpleNamespace(names=[n for n, _ in params[i : i + 5]], tensors=[t for _, t in params[i : i + 5]])
        for i in range(0, len(params), 5)
    ]
    before = {e["weight_version"] for e in run(loop, engine.client.engines())}
    res = run(loop, sender.send_chunks(iter(chunks)))
    assert {r["weight_version"] for r in res.values()} == {max(before) + 1} and len(res) == 2
    sender.teardown()


def test_cancelling_the_awaiting_tasks_cancels_the_requests_on_the_engines(engine, loop):
    """Issue 23: a cancelled task that awaits generate / stream / sample (the
    AsyncClient, the SkyRL adapter, the session helper) sends a Cancel; the
    engines go idle instead of generating on to max_tokens for nobody."""
    import time

    from bus import protocol as P
    from trainer_bridge.session import AsyncSession

    client = engine.client
    long = {"max_tokens": 1500, "ignore_eos": True}

    async def multi_turn(i: int) -> None:  # 8 trajectories: a finished short turn, then a long one
        async with AsyncSession(client, [5 + i, 17, 42], params={"max_tokens": 3}) as s:
            await s.generate()
            await s.add_observation([9, 9])
            await s.generate(long)

    async def streamed() -> None:
        async for _ in client.stream([7, 8, 9], long):
            pass

    async def running() -> int:  # each engine's own count now (Stats: a fresh heartbeat), not the head's lagging view
        return sum(r["running"] + r["waiting"] for r in (await client.control(P.Stats())).values())

    async def tokens_out() -> int:
        return sum(r["tokens_out"] for r in (await client.control(P.Stats())).values())

    sessions_before = run(loop, client.stats())["sessions"]

    async def scenario() -> tuple[float, int, int]:
        tasks = [asyncio.create_task(multi_turn(i)) for i in range(8)]
        tasks += [
            asyncio.create_task(
                engine.generate({"prompt_token_ids": [[3, 4, 5]], "sampling_params": params(max_tokens=1500)})
            ),
            asyncio.create_task(engine.sample([1, 2, 3], 2, params(max_tokens=1500, logprobs=None))),
            asyncio.create_task(streamed()),
        ]
        deadline = time.monotonic() + 30
        while await running() < 12:  # 8 sessions + generate + 2 samples + stream
            assert time.monotonic() < deadline, f"only {await running()} running"
            await asyncio.sleep(0.05)
        for t in tasks:
            t.cancel()
        t0 = time.monotonic()
        await asyncio.gather(*tasks, return_exceptions=True)
        while await running():
            assert time.monotonic() - t0 < 5.0, "engines still generating 5 s after the cancel"
        idle = time.monotonic() - t0
        out0 = await tokens_out()
        await asyncio.sleep(1.0)
        return idle, out0, await tokens_out()

    idle, out0, out1 = run(loop, scenario())
    print(f"engines idle {idle:.2f} s after the cancel")
    assert idle < 0.5  # issue 23's target
    assert out1 == out0
    assert run(loop, client.stats())["sessions"] == sessions_before  # the sessions' `async with` released them


def test_an_ipc_chunk_exported_by_this_process_is_read_without_opening_its_handle():
    """SkyRL's CUDA IPC sender and the adapter share one process; CUDA refuses
    to open a handle in the process that exported it, so the adapter must find
    torch's own storage for it (reduce_tensor caches it under the bare handle).
    Here a CPU storage stands in for the CUDA one under a made-up handle: the
    real rebuild_cuda_tensor would fail on this machine, so a result proves the
    local path was taken, and it must alias the exporter's memory."""
    import torch
    from torch.multiprocessing import reductions

    from trainer_bridge.skyrl.chunks import rebuild_shared

    packed = torch.arange(12, dtype=torch.float32)
    handle = b"made-up-cuda-ipc-handle"
    reductions.shared_cache[handle] = reductions.StorageWeakRef(packed.untyped_storage())
    try:
        args = (torch.Tensor, torch.Size([2, 3]), (3, 1), 6, torch.storage.TypedStorage, torch.float32, 0, handle)
        args += (packed.untyped_storage().nbytes(), 0, False, b"", 0, b"", False)
        t = rebuild_shared(reductions.rebuild_cuda_tensor, args)
        assert t.tolist() == [[6.0, 7.0, 8.0], [9.0, 10.0, 11.0]]
        packed[6] = -1.0
        assert t[0, 0].item() == -1.0  # the exporter's memory, not a copy
    finally:
        reductions.shared_cache.pop(handle, None)
    with pytest.raises((AssertionError, RuntimeError)):  # an unknown handle: torch opens it (no CUDA here)
        rebuild_shared(reductions.rebuild_cuda_tensor, args)
