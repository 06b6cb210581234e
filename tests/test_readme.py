"""The README's python blocks run as written against a real cluster."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.cluster import ROOT, child_env


def _block(tag: str) -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    m = re.search(r"```python " + re.escape(tag) + r"\n(.*?)```", text, re.S)
    assert m, f"README has no ```python {tag} block"
    return m.group(1)


def test_readme_rl_loop_runs(torch_cluster):
    # The module's cluster is shared: the loop's updates start from whatever
    # version earlier tests (in any order) left, not from 0.
    v0 = torch_cluster.client().health()["weight_version"]
    code = _block("rl-loop")
    p = subprocess.run(
        [sys.executable, "-c", code],
        env=child_env(ROLLOUT_BUS=torch_cluster.frontend),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    lines = [x for x in p.stdout.splitlines() if x.startswith("step ")]
    assert len(lines) == 3
    for k, line in enumerate(lines, 1):  # each update reached both engines, one version further
        assert line.endswith(f"versions [{v0 + k}, {v0 + k}]"), (v0, lines)


def _run_block(tag: str, cluster, code: str | None = None) -> str:
    p = subprocess.run(
        [sys.executable, "-c", code or _block(tag)],
        env=child_env(ROLLOUT_BUS=cluster.frontend),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_readme_text_and_session_block_runs(torch_cluster):
    lines = _run_block("text", torch_cluster).splitlines()
    assert lines[1] == "one two three"  # detokenize(tokenize(text))
    assert "{'e" in lines[-1] and lines[-1].count("'e") == 1  # the session stayed on one engine


def test_readme_skyrl_block_runs(torch_cluster):
    lines = _run_block("skyrl", torch_cluster).splitlines()
    *_, stop_reason, n_logprobs = lines[0].split()
    assert stop_reason in ("stop", "length") and (stop_reason == "stop" or n_logprobs == "16")
    assert lines[1] == "1 2 (2, 1)"


# Stands in for skyrl's BasePPOExp where skyrl is not installed: it owns a
# tokenizer and asks get_inference_client() for the engine, as SkyRL does.
_FAKE_SKYRL = """
import sys, types
from engine_node.tiny_model import ensure_tiny_model
from transformers import AutoTokenizer
try:
    import skyrl.train.entrypoints.main_base
except Exception:
    m = types.ModuleType("skyrl.train.entrypoints.main_base")
    class BasePPOExp:
        pass
    m.BasePPOExp = BasePPOExp
    for name in ("skyrl", "skyrl.train", "skyrl.train.entrypoints"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules[m.__name__] = m
"""


def test_readme_skyrl_entrypoint_lines_work(torch_cluster):
    code = _block("skyrl-exp")
    assert '"tcp://127.0.0.1:5555"' in code
    code = code.replace('"tcp://127.0.0.1:5555"', "os.environ['ROLLOUT_BUS']")
    check = (
        "\nexp = RolloutBusExp.__new__(RolloutBusExp)\n"
        "exp.tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())\n"
        "engine = exp.get_inference_client()\n"
        "out = asyncio.run(engine.generate({'prompt_token_ids': [[1, 5, 9]], 'sampling_params': {'max_tokens': 4, 'ignore_eos': True}}))\n"
        "print(len(out['response_ids'][0]), type(engine).__name__)\n"
    )
    out = _run_block("skyrl-exp", torch_cluster, "import asyncio, os\n" + _FAKE_SKYRL + code + check)
    assert out.split() == ["4", "RolloutBusEngine"]


def test_readme_multi_sender_block_runs(torch_cluster):
    before = torch_cluster.client().health()["weight_version"]
    out = _run_block("multi-sender", torch_cluster).splitlines()
    assert out[-1] == f"versions {before} -> [{before + 1}]", out
