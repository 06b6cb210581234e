"""Several trainer ranks feed ONE weight update over the GPU transports
(issue 11 item 2): each rank is its own process holding part of model B
(tests/gpu/multi_sender_rank.py), joins the coordinator's update by id and
sends its part (nccl: over its own NCCL group; cuda_ipc: its own buckets);
the coordinator commits once. The engine then serves B (teacher-forced
against transformers B), its version moved by exactly one. A rank that
vanishes aborts the update naming it; the engine keeps its weights and
version, and the next update succeeds.

nccl: trainer ranks on GPU 0, the engine on GPU 1 (needs 2 GPUs).
cuda_ipc: ranks and engine on GPU 0."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from bus.errors import ControlError
from tests.gpu.common import HF_GAP_TOL, gpu_count, hf_check, record_timing
from tests.gpu.test_vllm_e2e import _cluster, _greedy_tokens

pytestmark = [pytest.mark.timeout(900)]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _vllm() -> bool:
    try:
        import vllm  # noqa: F401

        return True
    except Exception:
        return False


def _rank(address: str, upd, rank: int, ranks: int, model: str, transport: str, vanish: bool = False):
    uid = upd.update_id
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), CUDA_VISIBLE_DEVICES="0")
    env["RB_SENDER_SECRET"] = upd.sender_secret  # the environment, not argv: other users read argv
    argv = [sys.executable, "-m", "tests.gpu.multi_sender_rank", address, uid, str(rank), str(ranks), model, transport]
    return subprocess.Popen(
        argv + (["--vanish"] if vanish else []),
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _wait_line(p: subprocess.Popen, word: str, timeout_s: float) -> str:
    end = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < end:
        line = p.stdout.readline()
        if not line:
            if p.poll() is not None:
                break
            continue
        seen.append(line)
        if line.startswith(word):
            return line
    raise AssertionError(f"rank process never printed {word!r} (rc={p.poll()}):\n" + "".join(seen[-40:]))


def _kill(ps) -> None:
    for p in ps:
        if p.poll() is None:
            p.kill()
        p.wait(10)


def _update(cl, address: str, model: str, transport: str, ranks: int = 2, vanish: int | None = None, timeout_s=60):
    """Coordinator: open, let each rank send its part, commit on leaving the block."""
    ps = []
    t0 = time.perf_counter()
    try:
        with cl.weight_update(senders=ranks, transport=transport, device="cuda:0", timeout_s=timeout_s) as upd:
            ps = [_rank(address, upd, r, ranks, model, transport, vanish=r == vanish) for r in range(ranks)]
            sent = [_wait_line(p, "SENT", 240) for r, p in enumerate(ps) if r != vanish]
        dt = time.perf_counter() - t0
        for p in ps:
            _wait_line(p, "RELEASED", 60)
            assert p.wait(60) == 0
        return upd.results, sent, dt
    finally:
        _kill(ps)


@pytest.mark.skipif(not _vllm(), reason="needs vLLM")
@pytest.mark.parametrize("transport", ["nccl", "cuda_ipc"])
def test_two_sender_ranks_make_one_update(model_dirs, transport):
    need = 2 if transport == "nccl" else 1
    if gpu_count() < need:
        pytest.skip(f"{transport}: needs {need} GPU(s), {gpu_count()} visible")
    gpus = "1" if transport == "nccl" else "0"
    c, dt = _cluster(model_dirs["A"], env={"CUDA_VISIBLE_DEVICES": gpus}, enable_lora=False)
    try:
        cl = c.client(timeout_s=120, control_timeout_s=120)
        v0 = cl.engines()[0]["weight_version"]
        res, sent, t_upd = _update(cl, c.frontend, model_dirs["B"], transport)
        ((eid, r),) = res.items()
        assert r["weight_version"] == v0 + 1, "one commit: version += 1 once"
        toks, out = _greedy_tokens(cl)
        assert all(set(o.samples[0].token_versions) == {v0 + 1} for o in out)
        gap, agree = hf_check(model_dirs["B"], toks)
        record_timing(
            f"multi_sender_{transport}_2_ranks",
            update_s=round(t_upd, 3),
            ranks=[s.split(" ", 1)[1].strip() for s in sent],
            max_logprob_gap_vs_hf_B=round(gap, 4),
            argmax_agreement=round(agree, 3),
        )
        assert gap < HF_GAP_TOL and agree > 0.9

        # a rank that vanishes before sending: the whole update aborts naming it
        before, _ = _greedy_tokens(cl)
        t0 = time.perf_counter()
        with pytest.raises(ControlError, match=r"sender\(s\) \[1\] never finished sending"):
            _update(cl, c.frontend, model_dirs["A"], transport, vanish=1, timeout_s=20)
        record_timing(f"multi_sender_{transport}_vanished_rank_abort", seconds=round(time.perf_counter() - t0, 3))
        assert cl.engines()[0]["weight_version"] == v0 + 1, "aborted: the version did not move"
        after, _ = _greedy_tokens(cl)
        assert after == before, "aborted: still B's weights (no part of A's rank 0 is visible)"

        # and the next update goes through (back to A)
        res, _, _ = _update(cl, c.frontend, model_dirs["A"], transport)
        assert next(iter(res.values()))["weight_version"] == v0 + 2
        gap, agree = hf_check(model_dirs["A"], _greedy_tokens(cl)[0])
        assert gap < HF_GAP_TOL and agree > 0.9
    finally:
        c.close()
