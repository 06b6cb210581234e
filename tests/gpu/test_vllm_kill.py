"""kill -9 of a vLLM engine node under load (issue 13, item 6, the GPU half).

launch.py starts a head and 2 vLLM engine nodes, one per GPU (its supervisor
restarts a dead engine). 64 greedy streams run; one node is killed with
SIGKILL. Measured from the kill:
  gpu_freed_s      until the killed engine's GPU holds no memory of its
                   processes (nvidia-smi: none of the node's tree's pids among
                   the compute apps, and memory.used back near its level
                   before launch; torch.cuda.mem_get_info without nvidia-smi)
  tree_gone_s      until every process of the killed node's tree is gone
                   (EngineCore, workers: engine_node/child_watch.py)
  healthy_again_s  until the supervisor's restart is registered and healthy
Every stream must finish whole (the head re-submits the killed engine's
requests elsewhere). Skipped without 2 GPUs and vLLM (tests/gpu/conftest.py).

The CPU half (same mechanism, a fault-injection backend) is
tests/test_engine_children.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.cluster import ROOT, Streams, child_env, wait_until
from tests.gpu.common import ENGINE_OPTS, gpu_count, prompts, record_timing

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

N_STREAMS = 64
MAX_TOKENS = 1024
FREED_SLACK_MIB = 1024  # memory.used within this of its pre-launch level counts as freed
FREED_WITHIN_S = 60.0
HEALTHY_WITHIN_S = 300.0
make_prompts = prompts  # tests/gpu/common's vocabulary; a CPU dry run swaps in the tiny model's


# ------------------------------------------------------------------ GPU memory, per GPU uuid


def _smi(args: list[str]) -> list[list[str]] | None:
    """Rows of an nvidia-smi CSV query (None without nvidia-smi)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    out = subprocess.run([exe, *args, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        return None
    return parse_csv(out.stdout)


def parse_csv(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.split(",")] for line in text.splitlines() if line.strip()]


def gpu_used_mib() -> dict[str, float]:
    """{gpu uuid: MiB used}, from nvidia-smi, else torch.cuda.mem_get_info."""
    rows = _smi(["--query-gpu=uuid,memory.used"])
    if rows is not None:
        return {r[0]: float(r[1]) for r in rows if len(r) >= 2 and re.match(r"^[\d.]+$", r[1])}
    import torch

    out = {}
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        out["GPU-" + str(torch.cuda.get_device_properties(i).uuid)] = (total - free) / 2**20
    return out


def compute_apps() -> dict[int, str] | None:
    """{pid: gpu uuid} of the processes holding GPU memory (None: unknown; in a
    container nvidia-smi may list none of them: PID namespaces)."""
    rows = _smi(["--query-compute-apps=pid,gpu_uuid"])
    if rows is None:
        return None
    return {int(r[0]): r[1] for r in rows if len(r) >= 2 and r[0].isdigit()}


def tree_pids(pid: int) -> set[int]:
    try:
        p = psutil.Process(pid)
        return {pid, *(c.pid for c in p.children(recursive=True))}
    except psutil.NoSuchProcess:
        return set()


def alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.add(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def alive_tree(pid: int) -> list[psutil.Process]:
    try:
        return [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def gpu_of(pids: set[int], position: int) -> str | None:
    """The uuid of the GPU these processes use: from the compute apps, else the
    `position`-th GPU this process sees (launch.py --gpus 0,1 puts engine i on
    GPU i). None without nvidia-smi."""
    apps = compute_apps() or {}
    uuids = {apps[p] for p in pids if p in apps}
    if len(uuids) == 1:
        return uuids.pop()
    rows = _smi(["--query-gpu=index,uuid"]) or []
    by_index = {r[0]: r[1] for r in rows if len(r) >= 2}
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    index = visible[position] if position < len(visible) else str(position)
    return by_index.get(index) or (index if index.startswith("GPU-") else None)


# ------------------------------------------------------------------ the run


def launch(model: str, backend_args: list[str], env: dict[str, str], log_path: str) -> subprocess.Popen:
    # Output to a file, not a pipe: vLLM's start-up logs (inherited by the
    # engine nodes) would fill a pipe nobody reads and block the engines.
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "launch.py", "--port", "0", "--engines", "2", "--model", model, *backend_args,
             "--max-restarts", "2", "--grace-s", "20", "--ready-timeout-s", "600", "--log-level", "WARNING"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip


def read_address(p: subprocess.Popen, log_path: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        with open(log_path, errors="replace") as f:
            text = f.read()
        m = re.search(r"trainer connects to: (tcp://\S+)", text)
        if m:
            return m.group(1)
        if p.poll() is not None:
            break
        time.sleep(0.5)
    raise AssertionError(f"launch.py printed no address (exit {p.poll()}):\n" + text[-20000:])


@pytest.mark.skipif(gpu_count() < 2, reason="needs 2 GPUs")
def test_kill_9_vllm_engine_node_frees_its_gpu_and_comes_back(model_dirs, tmp_path):
    opts = {k: v for k, v in ENGINE_OPTS.items() if k != "seed"}  # the node derives the seed
    args = ["--gpus", "0,1", "--backend", "vllm", "--backend-options", json.dumps(opts)]
    log_path = str(tmp_path / "launch.log")
    record_timing("vllm_kill_9_engine_node", **kill_run(model_dirs["A"], args, log_path, gpu=True))


def kill_run(model: str, backend_args: list[str], log_path: str, *, gpu: bool) -> dict:
    """The measurement (gpu=False: the same flow without GPU memory, for a dry run on CPU)."""
    from trainer_bridge import Client

    before = gpu_used_mib() if gpu else {}
    p = launch(model, backend_args, child_env(ROLLOUT_BUS_LOG_LEVEL="WARNING"), log_path)
    tree: list[psutil.Process] = []
    try:
        addr = read_address(p, log_path, 600)
        with Client(addr, timeout_s=600, control_timeout_s=120) as c:
            engines = {e["engine_id"]: e for e in c.engines()}
            assert len(engines) == 2 and all(e["healthy"] for e in engines.values()), engines
            victim = sorted(engines)[1]
            node = engines[victim]["pid"]
            inc0 = engines[victim]["incarnation"]
            params = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
            streams = Streams(c, make_prompts(N_STREAMS, 16, seed=99), params)

            def going() -> bool:
                assert not any(streams.errors), streams.errors
                return sum(streams.counts()) >= 32 * N_STREAMS

            wait_until(going, 120, "the streams to get going")
            both_busy = wait_until(
                lambda: all(e["running"] > 0 for e in c.engines()) and c.engines(), 60, "load on both engines"
            )
            pids = tree_pids(node)
            assert len(pids) >= 2, f"the node {node} has no EngineCore child: {pids}"
            during = gpu_used_mib() if gpu else {}
            uuid = gpu_of(pids, sorted(engines).index(victim)) if gpu else None
            tree = alive_tree(p.pid)

            t0 = time.monotonic()
            os.kill(node, signal.SIGKILL)

            def freed() -> bool:
                apps = compute_apps() if gpu else None
                if apps is not None and pids & set(apps):
                    return False
                if uuid is None:
                    return not alive(pids)
                return gpu_used_mib().get(uuid, 0.0) <= before.get(uuid, 0.0) + FREED_SLACK_MIB

            wait_until(lambda: not alive(pids), FREED_WITHIN_S, f"the killed node's tree {sorted(pids)} to die")
            tree_gone_s = time.monotonic() - t0
            wait_until(freed, FREED_WITHIN_S, f"GPU {uuid} to be released", interval=0.1)
            gpu_freed_s = time.monotonic() - t0

            def restarted() -> bool:
                e = {x["engine_id"]: x for x in c.engines()}.get(victim)
                return bool(e and e["incarnation"] != inc0 and e["healthy"])

            wait_until(restarted, HEALTHY_WITHIN_S, f"the supervisor to restart {victim}", interval=0.25)
            healthy_s = time.monotonic() - t0
            streams.join(timeout=600)
            assert streams.counts() == [MAX_TOKENS] * N_STREAMS, streams.counts()
            r = c.generate(make_prompts(8, 16, seed=5), {"max_tokens": 16, "temperature": 0.0, "ignore_eos": True})
            assert all(len(x.samples[0].token_ids) == 16 for x in r)
            return dict(
                streams=N_STREAMS,
                max_tokens=MAX_TOKENS,
                tree_pids=len(pids),
                gpu=uuid or "unknown",
                gpu_used_before_launch_mib=before.get(uuid or "", None),
                gpu_used_under_load_mib=during.get(uuid or "", None),
                running_at_kill={e["engine_id"]: e["running"] for e in both_busy},
                tree_gone_s=round(tree_gone_s, 2),
                gpu_freed_s=round(gpu_freed_s, 2),
                healthy_again_s=round(healthy_s, 2),
            )
    finally:
        tree = [*tree, *alive_tree(p.pid)]  # the first lives' processes and the restarted ones
        p.send_signal(signal.SIGTERM)
        try:
            p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate(timeout=30)
        _, left = psutil.wait_procs(tree, timeout=30)
        assert not alive({x.pid for x in left}), f"launch.py left {[x.pid for x in left]}"
