"""Issue 33 §1: engines land on the GPUs the user gave. `--gpus` and the
default "all visible" go through an inherited CUDA_VISIBLE_DEVICES (ids,
`GPU-<uuid>`, `MIG-…`): a job handed GPUs 4-7 starts its engines on 4-7, not
on 0-3 (fe0cb18 numbered them `range(torch.cuda.device_count())`).

The pure mapping is checked without processes; one test launches real engine
processes (null backend: no GPU needed to read what the child was given) and
reads each engine process's own environment."""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from bus.errors import BadRequest
from engine_node.cpu_placement import gpu_slot
from launcher.config import gpu_groups, parse_args, select_gpus, visible_gpus
from tests.cluster import ROOT, child_env

UUID_A = "GPU-6f1c2a3b-0000-1111-2222-333344445555"
UUID_B = "GPU-7e2d3c4b-0000-1111-2222-333344445555"


def _groups(mask: str | None, *flags: str, engines: int | None = None, count: int = 8) -> list[str | None]:
    a = parse_args(["--backend", "vllm", *flags])
    env = {} if mask is None else {"CUDA_VISIBLE_DEVICES": mask}
    return gpu_groups(a, "vllm", engines, env=env, device_count=lambda: count)


@pytest.mark.parametrize(
    ("mask", "flags", "want"),
    [
        ("1", (), ["1"]),  # fe0cb18: ["0"], the physical GPU 0 the job was not given
        ("2,3", (), ["2", "3"]),
        ("2,3", ("--tp", "2"), ["2,3"]),
        ("4,5,6,7", ("--gpus", "1,3"), ["5", "7"]),  # --gpus indexes what this job sees
        ("4,5,6,7", ("--gpus", "0,1,2,3", "--tp", "2"), ["4,5", "6,7"]),
        (UUID_A, (), [UUID_A]),
        (f"{UUID_A},{UUID_B}", ("--tp", "2"), [f"{UUID_A},{UUID_B}"]),
        (f"{UUID_A},{UUID_B}", ("--gpus", UUID_B), [UUID_B]),  # a name, taken as it is
        ("MIG-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9", (), ["MIG-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9"]),
        (None, (), [str(i) for i in range(8)]),  # no mask: every GPU, one engine each
        (None, ("--gpus", "6,7"), ["6", "7"]),
    ],
)
def test_engine_gpus_go_through_the_inherited_mask(mask, flags, want):
    assert _groups(mask, *flags) == want


def test_a_fixed_engine_count_takes_the_first_visible_gpus():
    assert _groups("3,5,7", engines=2) == ["3", "5"]
    assert _groups("3,5,7", "--tp", "1", engines=1) == ["3"]


@pytest.mark.parametrize(
    ("mask", "flags", "engines", "says"),
    [
        ("1", ("--tp", "2"), None, "CUDA_VISIBLE_DEVICES='1'"),  # one GPU, tp=2
        ("2,3", (), 3, "needs 3 GPU"),
        ("2,3", ("--gpus", "2"), None, "index 2 is past"),  # 2 is a physical id, not an index of this job's
        (UUID_A, ("--gpus", UUID_B), None, "not an index or a visible GPU"),
        ("2,3", ("--gpus", "0,0"), None, "names one GPU twice"),
        ("", (), None, "CUDA_VISIBLE_DEVICES=''"),  # an empty mask hides every GPU
        ("-1", (), None, "CUDA_VISIBLE_DEVICES=''"),
        (None, ("--gpus", "0"), None, "0 GPU(s) visible"),
    ],
)
def test_too_few_or_wrong_gpus_is_a_typed_error_naming_the_flag_and_the_mask(mask, flags, engines, says):
    with pytest.raises(BadRequest) as e:
        _groups(mask, *flags, engines=engines, count=0 if mask is None else 8)
    assert e.value.field == "gpus"
    assert says in str(e.value) and "--gpus" in str(e.value)


def test_visible_gpus_stops_where_cuda_stops_reading():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0, 2,x,3"}, lambda: 9) == (["0", "2"], True)
    assert visible_gpus({}, lambda: 2) == (["0", "1"], False)
    assert select_gpus(None, ["5"], True) == ["5"]


def test_backends_without_gpus_leave_the_mask_alone_unless_given_gpus():
    a = argparse.Namespace(gpus=None, tp=1)
    assert gpu_groups(a, "torch", None, env={"CUDA_VISIBLE_DEVICES": "3"}, device_count=lambda: 0) == [None, None]
    a.gpus = "0"
    assert gpu_groups(a, "null", None, env={"CUDA_VISIBLE_DEVICES": "3,4"}, device_count=lambda: 0) == ["3"]


def test_the_cpu_pinning_slot_is_the_engine_index_not_a_uuid():
    assert gpu_slot({"CUDA_VISIBLE_DEVICES": UUID_B, "ROLLOUT_BUS_GPU_SLOT": "1"}) == 1
    assert gpu_slot({"CUDA_VISIBLE_DEVICES": "5"}) == 5


def _engine_envs(p: subprocess.Popen, want: int, timeout_s: float) -> dict[str, dict[str, str]]:
    """engine id → its process's own environment, once `want` engines run."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = {}
        for c in psutil.Process(p.pid).children(recursive=True):
            try:
                cmd = c.cmdline()
                if "engine_node" in cmd:
                    found[cmd[cmd.index("--engine-id") + 1]] = c.environ()
            except (psutil.Error, ValueError):  # a child starting or ending meanwhile
                continue
        if len(found) >= want:
            return found
        if p.poll() is not None:
            break
        time.sleep(0.1)
    raise AssertionError(f"{want} engine processes not seen within {timeout_s}s (launcher rc={p.poll()})")


@pytest.mark.timeout(60)
def test_launched_engine_processes_get_the_masked_gpus():
    """Real launcher, real engine processes: mask `GPU-a,GPU-b,2,3`, --gpus 1,3
    → e0 sees GPU-b, e1 sees 3 (fe0cb18 ignored --gpus for a non-vLLM backend,
    and for vLLM gave 1 and 3)."""
    env = child_env(CUDA_VISIBLE_DEVICES=f"{UUID_A},{UUID_B},2,3")
    argv = [sys.executable, "launch.py", "--port", "0", "--grace-s", "5", "--backend", "null", "--gpus", "1,3"]
    p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        envs = _engine_envs(p, 2, 45)
        assert envs["e0"]["CUDA_VISIBLE_DEVICES"] == UUID_B
        assert envs["e1"]["CUDA_VISIBLE_DEVICES"] == "3"
        assert [envs[e]["ROLLOUT_BUS_GPU_SLOT"] for e in ("e0", "e1")] == ["0", "1"]
    finally:
        tree = psutil.Process(p.pid).children(recursive=True) if p.poll() is None else []
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=30)
        psutil.wait_procs(tree, timeout=10)


@pytest.mark.timeout(30)
def test_launch_refuses_too_few_gpus_before_starting_anything():
    env = child_env(CUDA_VISIBLE_DEVICES="1")
    argv = [sys.executable, "launch.py", "--port", "0", "--backend", "null", "--gpus", "0", "--tp", "2"]
    out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=25)
    assert out.returncode == 2, out.stdout + out.stderr
    assert re.search(r"--gpus.*CUDA_VISIBLE_DEVICES='1'", out.stderr), out.stderr
