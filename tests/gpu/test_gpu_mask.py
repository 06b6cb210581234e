"""Issue 33 §1 on GPUs: `CUDA_VISIBLE_DEVICES=1 launch.py …` puts the engine
on physical GPU 1 (fe0cb18 renumbered it to 0). Needs two GPUs:
`TESTS=tests/gpu/test_gpu_mask.py bash tests/gpu/run_on_device.sh` on
nvidia-h200-x2. The engine's vLLM processes are found on the GPU by
the memory it takes (nvidia-smi numbers GPUs by PCI bus order, independent of
any mask): physical GPU 1 fills, GPU 0 does not. The mask is given as an index
and as GPU 1's UUID."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.cluster import ROOT, child_env
from tests.gpu.common import gpu_count

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(400)]


def _uuids() -> dict[int, str]:
    out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"], capture_output=True,
                         text=True, check=True, timeout=30).stdout  # fmt: skip
    return {int(i): u.strip() for i, u in (line.split(",") for line in out.strip().splitlines())}


def _used_mib() -> dict[int, float]:
    """Physical index -> memory used (MiB). Memory, not the compute-apps pid list:
    in a container nvidia-smi may report host pids, which match nothing here."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True, timeout=30).stdout  # fmt: skip
    return {int(i): float(m) for i, m in (line.split(",") for line in out.strip().splitlines())}


@pytest.mark.skipif(gpu_count() < 2, reason="needs two GPUs (nvidia-h200-x2)")
@pytest.mark.parametrize("mask", ["1", "uuid"])
def test_the_engine_lands_on_the_gpu_the_mask_names(model_dirs, mask):
    uuids = _uuids()
    given = uuids[1] if mask == "uuid" else "1"
    before = _used_mib()
    env = child_env(CUDA_VISIBLE_DEVICES=given)
    argv = [sys.executable, "launch.py", "--port", "0", "--backend", "vllm", "--model", model_dirs["A"],
            "--gpu-memory-utilization", "0.3", "--max-model-len", "2048", "--ready-timeout-s", "300",
            "--backend-options", '{"enforce_eager": true}']  # fmt: skip
    p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = p.stdout.readline()
            lines.append(line)
            if "trainer connects to" in line or (not line and p.poll() is not None):
                break
        assert any("trainer connects to" in x for x in lines), "".join(lines)[-4000:]
        after = _used_mib()
        grew = {i: after[i] - before[i] for i in after}
        # --gpu-memory-utilization 0.3 of an H200: ~40 GiB on the engine's GPU, nothing on the other
        assert grew[1] > 8000 and grew[0] < 2000, f"memory grew by {grew} MiB; the engine belongs on physical GPU 1"
        engines = [c for c in psutil.Process(p.pid).children(recursive=True) if "engine_node" in c.cmdline()]
        assert [e.environ()["CUDA_VISIBLE_DEVICES"] for e in engines] == [given]
        assert re.search(r"^e0\s", "".join(lines), re.M)
    finally:
        tree_p = psutil.Process(p.pid).children(recursive=True) if p.poll() is None else []
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=60)
        psutil.wait_procs(tree_p, timeout=15)
