"""The README's RL loop runs as written against a real cluster."""

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
    assert "versions [3, 3]" in lines[-1]  # three updates reached both engines
