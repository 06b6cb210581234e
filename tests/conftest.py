"""Fixtures: a tiny model, real clusters, and a leak check on every test."""

from __future__ import annotations

import psutil
import pytest

from tests.cluster import Cluster, leak_checked_cluster, live_children


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """The launcher's own tiny random model (built once into the cache dir)."""
    from engine_node.tiny_model import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture(scope="module")
def torch_cluster(tiny_model):
    """Two torch engines behind a head, shared by a module's read-only tests."""
    # --direct-clients: some of these tests send straight to an engine (test_bad_input)
    with leak_checked_cluster(2, backend="torch", model=tiny_model, engine_args=["--direct-clients"]) as c:
        yield c


@pytest.fixture
def cluster_factory(tiny_model):
    made: list[Cluster] = []

    def make(n_engines: int = 2, **kw) -> Cluster:
        kw.setdefault("backend", "torch")
        if kw["backend"] == "torch":
            kw.setdefault("model", tiny_model)
        c = Cluster(n_engines, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.fixture(autouse=True)
def no_leaked_processes(request):
    """A test that spawns processes must leave none behind (module-scoped
    clusters are checked when their module ends)."""
    before = {p.pid for p in live_children()}
    yield
    if "torch_cluster" in request.fixturenames or "module_cluster" in request.fixturenames:
        return
    leaked = [p for p in live_children() if p.pid not in before]
    if leaked:
        for p in leaked:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        pytest.fail(f"leaked processes: {[(p.pid, ' '.join(p.cmdline()[:4])) for p in leaked]}")


@pytest.fixture
def vbe(tmp_path, monkeypatch):
    """The vLLM backend on the fake CPU engine core with the vLLM-shaped model
    (tests/test_vllm_weight_plan_cpu.py `vllm_like_backend`), closed after."""
    from tests.test_vllm_weight_plan_cpu import vllm_like_backend

    b = vllm_like_backend(tmp_path, monkeypatch)
    yield b
    b.close()
