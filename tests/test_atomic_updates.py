"""Issue 13 item 3: a weight update commits atomically across the cluster.

An engine is frozen (SIGSTOP) or killed in each phase of an update — begin,
buckets, prepare, commit — on a real head with real torch engines. Afterwards
every live engine is on one version, old or new, matching what the update
returned or raised; the error names the engine; a frozen engine that is
SIGCONT'ed later ends on the cluster's version or is reported stale (never a
third state, never serving a version the head does not know). Short deadlines
come from knobs: the update's timeout_s and the engines' --prepare-ttl-s.
"""

from __future__ import annotations

import signal
import time

import pytest
import torch

from bus.errors import ControlError
from tests.cluster import leak_checked_cluster, wait_until

T = 2.0  # the update's timeout_s: how long the head / the sender wait for an engine
TTL = 1.5  # engines' --prepare-ttl-s
PHASES = ("begin", "buckets", "prepare", "commit")


@pytest.fixture(scope="module")
def module_cluster(tiny_model):
    """One cluster for both tests (each leaves both engines healthy and in sync)."""
    with leak_checked_cluster(2, backend="torch", model=tiny_model, engine_args=["--prepare-ttl-s", str(TTL)]) as cl:
        yield cl


def _weights(tiny_model: str, seed: int) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    return [(n, p.detach() + torch.randn(p.shape, generator=g) * 0.01) for n, p in m.named_parameters()]


def _update(c, cl, victim: str, phase: str, sig: int, named):
    """One update with the victim hit in `phase`. Returns the results or the ControlError."""
    upd = c.weight_update(timeout_s=T, bucket_bytes=1 << 15)
    if phase == "begin":
        cl.kill(victim, sig)

    def tensors():
        for i, nt in enumerate(named):
            if phase == "buckets" and i == len(named) // 2:
                cl.kill(victim, sig)
            yield nt

    try:
        with upd:
            upd.sender(0).send(tensors())
            if phase == "prepare":
                cl.kill(victim, sig)
            if phase == "commit":
                upd.prepare()
                cl.kill(victim, sig)
    except ControlError as e:
        return e
    return upd.results


def _engines(c) -> dict[str, dict]:
    return c.health()["engines"]


def _check(c, survivor: str, victim: str, before: int, out) -> int:
    """The survivor is on the old version after an error naming the victim,
    on the new one after a commit. Returns the cluster version."""
    h = c.health()
    v = h["engines"][survivor]["weight_version"]
    if isinstance(out, ControlError):
        assert victim in str(out), str(out)
        assert v == before == h["weight_version"], (v, before, h["weight_version"])
    else:
        assert set(out) == {survivor}, out  # the victim missed the commit
        assert v == before + 1 == h["weight_version"] == out[survivor]["weight_version"]
    return h["weight_version"]


def _settled(c, victim: str, cluster_version: int) -> None:
    """A woken engine: on the cluster's version, or stale below it. Never ahead."""

    def ok():
        e = _engines(c)[victim]
        fresh = e["heartbeat_age_s"] is not None and e["heartbeat_age_s"] < 0.5
        return fresh and e["state"] in ("healthy", "stale") and e

    e = wait_until(ok, 20, f"{victim} to report again")
    assert e["weight_version"] <= cluster_version, e
    assert e["weight_version"] == cluster_version or e["state"] == "stale", e


def _in_sync(c, cl, victim: str, named) -> None:
    """Bring the victim back to the cluster's version for the next round."""
    wait_until(lambda: _engines(c)[victim]["state"] in ("healthy", "stale"), 60, f"{victim} to join")
    if _engines(c)[victim]["state"] == "stale":
        c.sync_stale(named)
    wait_until(lambda: all(e["healthy"] for e in _engines(c).values()), 20, "both engines healthy")


def test_freezing_an_engine_in_each_phase_keeps_the_cluster_on_one_version(module_cluster, tiny_model):
    cluster = module_cluster
    c = cluster.client(control_timeout_s=10)
    current = _weights(tiny_model, 0)
    for i, phase in enumerate(PHASES):
        before = c.health()["weight_version"]
        named = _weights(tiny_model, i + 1)
        t0 = time.monotonic()
        try:
            out = _update(c, cluster, "e1", phase, signal.SIGSTOP, named)
        finally:
            cluster.kill("e1", signal.SIGCONT)
        version = _check(c, "e0", "e1", before, out)
        if phase == "commit":
            assert not isinstance(out, ControlError), out  # prepared by all: the head committed
        assert time.monotonic() - t0 < 4 * T + 5
        time.sleep(TTL + 0.3)  # past its prepare_ttl_s: whatever it held undecided is gone
        _settled(c, "e1", version)
        if not isinstance(out, ControlError):
            current = named
        _in_sync(c, cluster, "e1", current)


def test_killing_an_engine_in_each_phase_keeps_the_survivors_on_one_version(module_cluster, tiny_model):
    cluster = module_cluster
    c = cluster.client(control_timeout_s=10)
    current = _weights(tiny_model, 0)
    for i, phase in enumerate(PHASES):
        before = c.health()["weight_version"]
        named = _weights(tiny_model, i + 10)
        out = _update(c, cluster, "e1", phase, signal.SIGKILL, named)
        version = _check(c, "e0", "e1", before, out)
        if not isinstance(out, ControlError):
            current = named
        cluster.start_engine("e1")  # comes back from its checkpoint: stale if the cluster moved
        wait_until(lambda: _engines(c).get("e1", {}).get("state") in ("healthy", "stale"), 60, "e1 to rejoin")
        _settled(c, "e1", version)
        _in_sync(c, cluster, "e1", current)
    assert {e["weight_version"] for e in _engines(c).values()} == {c.health()["weight_version"]}
