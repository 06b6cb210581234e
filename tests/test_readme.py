"""The python blocks of README.md and docs/*.md run as written against a real
cluster, and every flag they name exists on the command it is shown with."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

from tests.cluster import ROOT, child_env

# The README and every page of docs/ (issue 35: the README's detail moved there): a
# snippet or a flag moved into docs/ is still checked.
DOCS = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
# A tagged block runs in a test below; an untagged ```python block is an illustration.
TAGGED = re.compile(r"```python ([\w-]+)\n(.*?)```", re.S)


def _read(doc: str) -> str:
    with open(os.path.join(ROOT, doc)) as f:
        return f.read()


def _block(tag: str) -> str:
    found = [m.group(2) for doc in DOCS for m in TAGGED.finditer(_read(doc)) if m.group(1) == tag]
    assert len(found) == 1, f"{len(found)} ```python {tag} blocks in {DOCS} (want exactly one)"
    return found[0]


# The tests below that run each tagged block: a new tagged block needs one.
RUN_TAGS = {"rl-loop", "text", "skyrl", "skyrl-exp", "multi-sender"}


def test_every_tagged_block_in_the_docs_is_run():
    tags = {m.group(1) for doc in DOCS for m in TAGGED.finditer(_read(doc))}
    assert tags == RUN_TAGS, f"tagged blocks with no test: {tags - RUN_TAGS}; tests with no block: {RUN_TAGS - tags}"


def test_the_docs_pages_are_linked_from_the_readme():
    readme = _read("README.md")
    assert len(DOCS) > 5, DOCS
    unlinked = [d for d in DOCS[1:] if f"]({d})" not in readme]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"
    assert readme.count("\n") <= 300, "the README is the front door: keep it <= 300 lines, detail goes to docs/"


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


# A command a README paragraph names, and whose flags the flags after it are.
_COMMAND = re.compile(r"python -m ([\w.]+)|launch\.py keys|launch\.py|pip install|ruff|pytest|pre-commit")


def _flags_of(command: str) -> set[str] | None:
    """The flags `command` takes (None: not ours to check)."""
    import dataclasses

    import launcher.config
    import launcher.keys
    from router_node.config import RouterConfig

    if command == "launch.py":
        return set(launcher.config.build_parser()._option_string_actions)
    if command == "launch.py keys":
        ap = launcher.keys._keys_parser()
        subs = [a for a in ap._actions if a.choices and isinstance(a.choices, dict)]
        return set(ap._option_string_actions).union(
            *(set(p._option_string_actions) for s in subs for p in s.choices.values())
        )
    if command == "python -m router_node":
        head = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(RouterConfig)}
        return head | {"--no-failover", "--ready-file", "--help"}
    if command == "python -m engine_node":  # its parser is built inside parse_args: read its flags
        with open(os.path.join(ROOT, "engine_node", "config.py")) as f:
            return set(re.findall(r'"(--[a-z][a-z0-9-]*)"', f.read()))
    return None  # pip, ruff, pytest, the benches (bench/README.md): their own


@pytest.mark.parametrize("doc", DOCS)
def test_every_flag_the_docs_name_works_on_the_command_it_is_shown_with(doc):
    """Issue 35: the README named head-only flags (`--max-inflight-per-client`)
    in prose, where a newcomer passes them to launch.py: `unrecognized
    arguments`. A flag belongs to the last command named before it in its
    paragraph (a code block's line, a prose paragraph), else to launch.py."""
    paragraphs = re.split(r"\n\s*\n", _read(doc))
    wrong = []
    for para in paragraphs:
        marks = sorted(
            [(m.start(), "cmd", m.group(0)) for m in _COMMAND.finditer(para)]
            + [(m.start(), "flag", m.group(1)) for m in re.finditer(r"(?<![\w-])(--[a-z][a-z0-9-]*)", para)]
        )
        command = "launch.py"
        for _, kind, text in marks:
            if kind == "cmd":
                command = text
                continue
            flags = _flags_of(command)
            if flags is not None and text not in flags:
                wrong.append(f"{text} (shown with {command}) in: {para.strip()[:120]!r}")
    assert not wrong, "\n".join(wrong)
