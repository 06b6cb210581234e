"""In-flight weight updates that keep the KV cache (issue 21 §3, PipelineRL's
way), on real torch engines: `with client.paused("keep"): update_weights(...)`
leaves every running sequence in its engine with its KV cache; on resume each
continues at once on the new weights. Checked per stream against a
transformers reference that does exactly that: the prefix's KV computed by the
OLD model, every later token by the NEW model on top of it."""

from __future__ import annotations

import inspect

import torch

from bus import protocol as P
from tests.cluster import Streams, wait_until
from tests.test_control_plane import _perturbed

N, MAX_TOKENS = 6, 400
GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_tokens": MAX_TOKENS}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(21)
    return [torch.randint(4, 500, (3 + i,), generator=g).tolist() for i in range(N)]


def _prefills(c) -> int:
    """Prompts the engines' models prefilled so far (torch backend stat)."""
    return sum(r.detail["prefills"] for r in c.control(P.Stats()).values())


def _old_kv_then_new(old, new, prompt: list[int], head: list[int], n: int) -> list[int]:
    """What an engine does across a keep-mode update: the prompt and the first
    `len(head)` generated tokens fed to the OLD model exactly as the engine fed
    them (the prompt in one forward, then one token at a time; the last token
    is fed after the resume), then greedy on the NEW model on top of that KV."""
    from transformers import DynamicCache

    arg = "cache" if "cache" in inspect.signature(type(old).forward).parameters else "past_key_values"
    cache = DynamicCache(config=old.config)

    def feed(model, ids: list[int]) -> int:
        out = model(input_ids=torch.tensor([ids]), use_cache=True, **{arg: cache})
        return int(out.logits[0, -1].float().argmax())

    with torch.no_grad():
        nxt = feed(old, prompt)
        assert nxt == head[0], "the first token: the old model's"
        for i in range(len(head) - 1):
            nxt = feed(old, [head[i]])
            assert nxt == head[i + 1], f"token {i + 1} before the pause: the old model's"
        out, cur = [], head[-1]
        for _ in range(n):
            cur = feed(new, [cur])
            out.append(cur)
    return out


def test_keep_update_continues_every_stream_on_the_new_weights_with_its_old_kv(cluster_factory, tiny_model):
    from transformers import AutoModelForCausalLM

    cl = cluster_factory(2)
    cl.wait_ready(2)
    c = cl.client()
    old = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    new = _perturbed(tiny_model, seed=11)  # built before the streams start (it takes a while)
    ps = _prompts()
    s = Streams(c, ps, GREEDY)
    wait_until(lambda: min(s.counts()) >= 3, 60, "every stream to start")
    prefills = _prefills(c)
    res = c.pause("keep")
    try:
        assert sum(r["parked"] for r in res.values()) == 0, res
        assert sum(r["frozen"] for r in res.values()) == N, res  # every stream frozen in its engine
        up = c.update_weights(new.named_parameters())
    finally:
        c.resume()
    assert {r["weight_version"] for r in up.values()} == {1}
    s.join(120)
    assert _prefills(c) == prefills, "a stream was re-prefilled: keep must not re-submit"
    for i, p in enumerate(ps):
        toks = s.tokens(i)
        versions = [ch.weight_version for ch in s.chunks[i] for _ in ch.token_ids]
        assert len(toks) == MAX_TOKENS and s.chunks[i][-1].finish_reason == "length", "lost or truncated"
        k = versions.count(0)
        assert 3 <= k < MAX_TOKENS, f"stream {i}: {k} tokens before the update"
        assert versions == [0] * k + [1] * (MAX_TOKENS - k), f"stream {i}: versions switch exactly at the pause"
        assert all(ch.restarts == 0 for ch in s.chunks[i])
        assert toks[k:] == _old_kv_then_new(old, new, p, toks[:k], MAX_TOKENS - k), f"stream {i}"
