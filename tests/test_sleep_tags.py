"""Sleep and wake by tags on real torch engines (issue 21 §1), the way vLLM and
SkyRL do them: sleep(level) puts "weights" and "kv_cache" to sleep, wake_up(tags)
wakes them in any order and split, and the engines serve again only once no tag
is asleep. SkyRL's colocate_all order: sleep() -> wake_up(["weights"]) ->
weight sync -> wake_up(["kv_cache"]) -> generate, greedy equal to a
transformers reference on the new weights."""

from __future__ import annotations

import time

import pytest

from bus.errors import BadRequest, ControlError
from tests.cluster import Streams, wait_until
from tests.test_control_plane import _perturbed, _reference

GREEDY = {"temperature": 0.0, "ignore_eos": True}
P = [51, 52, 53, 54]
ENGINES = ("e0", "e1")


def asleep_everywhere(c, tags: list[str], level: int) -> bool:
    """Every engine's health (its heartbeat, or a newer ack) shows these tags asleep."""
    es = c.health()["engines"]
    return all(es[e]["asleep"] == tags and es[e]["sleeping"] == (level if tags else 0) for e in ENGINES)


def check_asleep(c, tags: list[str], level: int) -> None:
    wait_until(lambda: asleep_everywhere(c, tags, level), 10, f"health to show asleep={tags} sleeping={level}")
    es = c.health()["engines"]
    for e in ENGINES:
        assert es[e]["intended"]["asleep"] == tags, es[e]
    assert c.health()["intended"]["asleep"] == tags


@pytest.fixture(scope="module")
def cl(torch_cluster):
    return torch_cluster


ORDERS = [
    [None],
    [["weights"], ["kv_cache"]],
    [["kv_cache"], ["weights"]],
    [["weights", "kv_cache"]],
    [["kv_cache"], ["kv_cache"], [], ["weights"]],  # repeats and empties are no-ops
]


@pytest.mark.parametrize("level", [1, 2])
def test_every_order_and_split_of_wakes_ends_sleep_and_serves(cl, level):
    c = cl.client()
    params = {**GREEDY, "max_tokens": 12}
    before = c.generate(P, params).token_ids
    # level 2 reloads the checkpoint at each weights wake: the splits only (CI time)
    for order in ORDERS if level == 1 else ORDERS[1:3]:
        c.sleep(level)
        check_asleep(c, ["kv_cache", "weights"], level)
        held = Streams(c, [P], params)
        for tags in order[:-1]:
            res = c.wake_up(tags)
            assert set(res) == set(ENGINES)
            left = sorted({"weights", "kv_cache"} - {t for o in order[: order.index(tags) + 1] for t in (o or [])})
            assert all(r["detail"]["asleep"] == left for r in res.values()), res
            check_asleep(c, left, level)
            time.sleep(0.2)
            assert held.counts() == [0], f"served with {left} still asleep (order {order})"
            assert c.is_paused()
        res = c.wake_up(order[-1])
        assert all(r["detail"]["asleep"] == [] for r in res.values()), res
        check_asleep(c, [], 0)
        held.join(60)
        assert held.tokens(0) == before, f"order {order}"
        assert not c.is_paused()
        res = c.wake_up(["weights"])  # awake already: a no-op, not an error
        assert all(r["detail"]["asleep"] == [] and r["resumed"] == 0 for r in res.values()), res
    assert c.generate(P, params).token_ids == before


def test_unknown_tags_are_refused_naming_the_field_and_the_cluster_serves(cl):
    c = cl.client()
    with pytest.raises(BadRequest) as e:
        c.wake_up(["weights", "everything"])
    assert e.value.field == "tags" and "everything" in str(e.value)
    c.sleep(1)
    with pytest.raises(BadRequest):
        c.wake_up(["kv"])
    check_asleep(c, ["kv_cache", "weights"], 1)  # a refused wake changes nothing
    c.wake_up()
    assert len(c.generate(P, {**GREEDY, "max_tokens": 4}).token_ids) == 4


def test_skyrl_order_weight_update_between_the_wakes(cl, tiny_model):
    """sleep -> wake weights -> zmq update -> wake kv_cache -> greedy equals a
    reference on the new weights, every token stamped with the new version.
    Level 2 discards the weights: waking them reloads the checkpoint, the
    update replaces it before anything is served: one new version either way."""
    c = cl.client()
    v = max(x["weight_version"] for x in c.engines())
    for level in (1, 2):
        v = _skyrl_step(c, tiny_model, level, v)


def _skyrl_step(c, tiny_model: str, level: int, v0: int) -> int:
    params = {**GREEDY, "max_tokens": 12, "logprobs": True}
    new = _perturbed(tiny_model, seed=7 + level)
    ref_toks, ref_lps = _reference(new, P, 12)
    old = c.generate(P, params)
    assert old.token_ids != ref_toks
    c.sleep(level)
    held = Streams(c, [P], {**GREEDY, "max_tokens": 12})
    with pytest.raises(ControlError) as e:  # the weights sleep: refused, nothing changes
        c.update_weights(new.named_parameters())
    assert "wake_up(tags=['weights'])" in str(e.value)
    assert {x["weight_version"] for x in c.engines()} == {v0}
    res = c.wake_up(["weights"])
    # Level 2: the checkpoint is back, but nothing is served before the update
    # below writes the new weights, so the version does not move here.
    assert not any(r["weights_reloaded_from_checkpoint"] for r in res.values()), res
    assert {x["weight_version"] for x in c.engines()} == {v0}
    check_asleep(c, ["kv_cache"], level)
    up = c.update_weights(new.named_parameters(), bucket_bytes=1 << 16)
    version = v0 + 1  # SkyRL's order: one version per step, at both levels
    assert {r["weight_version"] for r in up.values()} == {version}
    time.sleep(0.2)
    assert held.counts() == [0], "served before the KV cache woke"
    c.wake_up(["kv_cache"])
    check_asleep(c, [], 0)
    held.join(60)
    assert held.tokens(0) == ref_toks
    assert {ch.weight_version for ch in held.chunks[0]} == {version}
    for _ in ENGINES:  # both engines
        out = c.generate(P, params)
        assert out.token_ids == ref_toks
        assert max(abs(a - b) for a, b in zip(out.logprobs, ref_lps, strict=True)) <= 1e-5
        assert set(out.token_versions) == {version}
    return version


def test_an_engine_restarted_while_the_cluster_is_half_awake_gets_the_same_tags(cluster_factory):
    """The head's intent is per tag: a restarted engine is brought to weights
    awake / KV cache asleep (Sleep, then WakeUp(["weights"])) before it serves,
    and serves with the cluster after the last wake. (Its own cluster: on one
    whose weights were updated, the restarted engine would be stale.)"""
    import signal

    cl = cluster_factory(2)
    cl.wait_ready(2)
    c = cl.client()
    c.sleep(1)
    c.wake_up(["weights"])
    check_asleep(c, ["kv_cache"], 1)
    old = c.health()["engines"]["e1"]["incarnation"]
    cl.kill("e1", signal.SIGKILL)
    cl.start_engine("e1")

    def rejoined_half_awake() -> bool:
        e = c.health()["engines"].get("e1", {})
        return e.get("incarnation") not in (None, old) and e["healthy"] and e["asleep"] == ["kv_cache"]

    wait_until(rejoined_half_awake, 120, "the restarted e1 to reach the cluster's tags")
    assert c.health()["engines"]["e1"]["sleeping"] == 1
    check_asleep(c, ["kv_cache"], 1)
    c.wake_up(["kv_cache"])
    check_asleep(c, [], 0)
    out = c.generate([P] * 6, {**GREEDY, "max_tokens": 6})
    assert all(len(r.token_ids) == 6 for r in out)
    wait_until(lambda: c.health()["engines"]["e1"]["tokens_out"] > 0, 10, "e1 to serve")
