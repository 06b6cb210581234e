"""Issue 11 item 2: several senders in one update. A coordinator opens the
update, sender ranks in their own processes send their part over zmq through
their own Client (`weight_sender(update_id, rank, sender_secret=...)`: the
coordinator hands both over), the coordinator commits:
all-or-nothing across senders and engines, version += 1 once; a sender that
vanishes or fails aborts the whole update with an error naming it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from bus.errors import BadRequest, ControlError
from tests.cluster import ROOT, child_env, leak_checked_cluster

T = 20.0

# A sender rank: the same perturbed weights as the test (same seed), its slice
# named[rank::n]. VANISH: the process dies (os._exit) halfway through its part.
SENDER = r"""
import os, sys, torch
from transformers import AutoModelForCausalLM
from trainer_bridge import Client
front, model, uid, rank, n, seed, mode = sys.argv[1:8]
secret = os.environ["RB_SENDER_SECRET"]  # the coordinator's upd.sender_secret (not argv: other users read argv)
rank, n, seed = int(rank), int(n), int(seed)
m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
g = torch.Generator().manual_seed(seed)
named = [(k, p.detach() + torch.randn(p.shape, generator=g) * 0.05) for k, p in m.named_parameters()][rank::n]
if mode == "bad":
    named[0] = ("model.no_such.weight", named[0][1])
def part():
    for i, nt in enumerate(named):
        if mode == "vanish" and i == len(named) // 2:
            os._exit(3)
        yield nt
with Client(front, control_timeout_s=30) as c:
    s = c.weight_sender(uid, rank, bucket_bytes=1 << 15, sender_secret=secret)
    print(s.send(part()), flush=True)
"""


def _perturbed(tiny_model: str, seed: int):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in m.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return m.eval()


def _senders(
    cl, tiny_model: str, upd, n: int, seed: int, modes: dict[int, str], ranks: range | None = None
) -> list[subprocess.Popen]:
    uid, secret = upd.update_id, upd.sender_secret  # what a coordinator hands its sender processes
    return [
        subprocess.Popen(
            [sys.executable, "-c", SENDER, cl.frontend, tiny_model, uid, str(r), str(n), str(seed), modes.get(r, "ok")],
            env={**child_env(), "RB_SENDER_SECRET": secret},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in ranks or range(n)
    ]


def _reap(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    out = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
        out.append((p.returncode, text))
    return out


@pytest.fixture(scope="module")
def module_cluster(tiny_model):
    """One cluster for the module's tests: an aborted update leaves it as it
    was, and each test reads the version it starts from."""
    # Sender processes import torch + transformers before their first bucket
    # (tens of seconds on a loaded CI box): the engines' idle limit for an open
    # update (--prepare-ttl-s) must outlast that.
    with leak_checked_cluster(2, backend="torch", model=tiny_model, engine_args=["--prepare-ttl-s", "300"]) as cl:
        yield cl


@pytest.fixture
def cluster(module_cluster):
    return module_cluster


def _part(tiny_model: str, seed: int, rank: int, n: int, bad: bool = False) -> list:
    named = list(_perturbed(tiny_model, seed).named_parameters())[rank::n]
    if bad:
        named[0] = ("model.no_such.weight", named[0][1])
    return named


def test_two_sender_processes_and_the_coordinator_make_one_update(cluster, tiny_model):
    c = cluster.client(control_timeout_s=T)
    p, greedy = [21, 22, 23, 24], {"max_tokens": 8, "temperature": 0.0}
    v0 = c.health()["weight_version"]
    with c.weight_update(senders=3, bucket_bytes=1 << 15) as upd:
        procs = _senders(cluster, tiny_model, upd, 3, seed=7, modes={}, ranks=range(1, 3))
        upd.sender(0).send(iter(_part(tiny_model, 7, 0, 3)))  # rank 0 is the coordinator's own process
        results = _reap(procs)
        assert [rc for rc, _ in results] == [0, 0], results
    assert {e: r["weight_version"] for e, r in upd.results.items()} == {"e0": v0 + 1, "e1": v0 + 1}  # += 1 once
    ref = _perturbed(tiny_model, seed=7)
    with torch.no_grad():
        want = ref.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    for _ in range(2):  # both engines serve exactly the union of the three parts
        assert c.generate(p, greedy).token_ids == want[0, len(p) :].tolist()
    assert c.health()["weight_version"] == v0 + 1


@pytest.mark.parametrize("mode", ["vanish", "bad"])
def test_a_sender_that_vanishes_or_fails_aborts_the_whole_update(cluster, tiny_model, mode):
    c = cluster.client(control_timeout_s=T)
    p, greedy = [31, 32, 33], {"max_tokens": 8, "temperature": 0.0}
    before = c.generate(p, greedy).token_ids
    v0 = c.health()["weight_version"]
    upd = c.weight_update(senders=2, bucket_bytes=1 << 15, timeout_s=8.0)
    with pytest.raises(ControlError) as e:
        with upd:
            upd.sender(0).send(iter(_part(tiny_model, 8, 0, 2)))
            if mode == "vanish":  # rank 1: a process that dies halfway through its part
                results = _reap(_senders(cluster, tiny_model, upd, 2, 8, {1: mode}, ranks=range(1, 2)))
                assert results[0][0] == 3, results
            else:  # rank 1 sends a tensor the model does not have
                upd.sender(1).send(iter(_part(tiny_model, 8, 1, 2, bad=True)))
    if mode == "vanish":
        assert "sender(s) [1] never finished" in str(e.value)
    else:
        assert "model.no_such.weight" in str(e.value)
    assert {x["weight_version"] for x in c.engines()} == {v0} and c.health()["weight_version"] == v0
    assert c.generate(p, greedy).token_ids == before


def test_colocated_ranks_each_feed_only_the_engine_on_their_own_gpu(cluster, tiny_model):
    """SkyRL's colocate_all shape (issue 33 §3): every rank holds the FULL
    tensors and feeds only its own engine (`weight_sender(..., engines=[eid])`);
    the other engines get its empty part. One update, committed once: both
    engines serve the new weights at version + 1 (on main the part went to
    every engine: each got every tensor twice and the update was refused)."""
    c = cluster.client(control_timeout_s=T)
    p, greedy = [41, 42, 43, 44], {"max_tokens": 8, "temperature": 0.0}
    v0 = c.health()["weight_version"]
    full = list(_perturbed(tiny_model, 9).named_parameters())
    ranks = [cluster.client(control_timeout_s=T) for _ in range(2)]
    with c.weight_update(senders=2, bucket_bytes=1 << 15) as upd:
        with pytest.raises(BadRequest) as e:  # the update id alone does not make a sender of it
            ranks[0].weight_sender(upd.update_id, 0, engines=["e0"])
        assert e.value.field == "sender_secret"
        with pytest.raises(BadRequest, match="not targets") as e:
            ranks[0].weight_sender(upd.update_id, 0, engines=["no-such-engine"], sender_secret=upd.sender_secret)
        assert e.value.field == "engines"
        for r, rc in enumerate(ranks):
            stats = rc.weight_sender(upd.update_id, r, engines=[f"e{r}"], sender_secret=upd.sender_secret)
            stats = stats.send(iter(full))
            assert stats["empty_parts"] == [f"e{1 - r}"]
    assert {e: r["weight_version"] for e, r in upd.results.items()} == {"e0": v0 + 1, "e1": v0 + 1}
    ref = _perturbed(tiny_model, seed=9)
    with torch.no_grad():
        want = ref.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    served = set()
    for i in range(32):  # sessions stick to an engine: until both served, each from one full copy
        out = c.generate(p, greedy, session_id=f"colocated-{i}")
        assert out.token_ids == want[0, len(p) :].tolist() and set(out.token_versions) == {v0 + 1}
        served.add(out.engine_id)
        if len(served) == 2:
            break
    assert served == {"e0", "e1"}
    assert c.health()["weight_version"] == v0 + 1
