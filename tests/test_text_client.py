"""Text and chat in the client, and the multi-turn token-in/token-out session
helper, against real torch engines."""

from __future__ import annotations

import pytest

from bus.errors import BadRequest, ClosedByUs
from trainer_bridge.session import Session

# The tiny model's tokenizer has no chat template; give it a simple one (tests only).
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}assistant{% endif %}"
)
GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def chat_tokenizer(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def test_text_prompts_carry_text_and_match_token_prompts(torch_cluster, chat_tokenizer):
    c = torch_cluster.client(tokenizer=chat_tokenizer)
    ids = c.tokenize("the quick brown fox")
    assert ids == chat_tokenizer.encode("the quick brown fox")
    by_text = c.generate("the quick brown fox", GREEDY)
    by_ids = c.generate(ids, GREEDY)
    assert by_text.token_ids == by_ids.token_ids and len(by_text.token_ids) == 6
    assert (
        by_text.text
        == c.detokenize(by_text.token_ids)
        == chat_tokenizer.decode(by_text.token_ids, skip_special_tokens=True)
    )
    assert by_ids.text == by_text.text  # a client with a tokenizer decodes token prompts too
    batch = c.generate(["hello world", "one two three"], GREEDY)  # a batch of strings, order kept
    assert [r.token_ids for r in batch] == [c.generate(p, GREEDY).token_ids for p in ["hello world", "one two three"]]


def test_chat_prompts_use_the_chat_template(torch_cluster, chat_tokenizer):
    c = torch_cluster.client(tokenizer=chat_tokenizer)
    chat = [{"role": "user", "content": "hello world"}]
    ids = chat_tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert c.tokenize(chat) == list(ids)
    assert c.generate(chat, GREEDY).token_ids == c.generate(list(ids), GREEDY).token_ids
    two = c.generate([chat, chat + [{"role": "assistant", "content": "one two"}]], GREEDY)  # a batch of chats
    assert len(two) == 2 and all(len(r.token_ids) == 6 and r.text is not None for r in two)


def test_model_path_default_tokenizer(torch_cluster, tiny_model):
    c = torch_cluster.client()  # no tokenizer: the engines' model folder is local
    assert c.generate([5, 17, 42], GREEDY).text is None  # token-only traffic: no tokenizer loaded, no text
    r = c.generate("hello world", GREEDY)
    assert r.text == c.detokenize(r.token_ids) and c.text().name == tiny_model
    with pytest.raises(BadRequest) as e:  # the tiny model ships no chat template
        c.generate([{"role": "user", "content": "hi"}], GREEDY)
    assert e.value.field == "messages"
    with pytest.raises(BadRequest) as e:
        torch_cluster.client(tokenizer="/no/such/folder").tokenize("x")
    assert e.value.field == "tokenizer"


def test_multi_turn_session_keeps_tokens_and_one_engine(torch_cluster, chat_tokenizer):
    c = torch_cluster.client(tokenizer=chat_tokenizer)
    prompt = [{"role": "user", "content": "one two three"}]
    params = {"max_tokens": 5, "temperature": 1.0, "seed": 3, "logprobs": True, "ignore_eos": True}
    with Session(c, prompt, params=params, session_id="traj-1") as s:
        t1 = s.generate()
        s.add_observation("four five six")
        obs_ids = s.turns[-1].token_ids
        t2 = s.generate()
        s.add_observation([7, 8, 9])
        t3 = s.generate()
        # no re-tokenization: the trajectory is exactly the concatenation of each turn's ids
        assert s.token_ids == c.tokenize(prompt) + t1.token_ids + obs_ids + t2.token_ids + [7, 8, 9] + t3.token_ids
        assert obs_ids == chat_tokenizer.encode("four five six", add_special_tokens=False)
        assert s.loss_mask == [1] * 5 + [0] * len(obs_ids) + [1] * 5 + [0] * 3 + [1] * 5
        assert len(s.logprobs) == len(s.response_ids) == len(s.loss_mask)
        assert len(s.engine_ids) == 1  # the router kept the trajectory on one engine
        assert c.stats()["sessions"] >= 1
        # the last turn, regenerated from the same ids and seed without the helper, is identical
        again = c.generate(s.token_ids[: -len(t3.token_ids)], params)
        assert again.token_ids == t3.token_ids
    assert c.end_session("traj-1") is False  # closing the session already released it
    with pytest.raises(ClosedByUs):
        s.generate()
