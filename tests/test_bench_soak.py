"""The soak counts every token (bench/soak.py, issue 36 row 1): every answer's
token count, finish reason and chunk order are checked against what was asked,
and a request that comes back short fails the soak. The real path: a head and
2 engines whose backend (tests/truncating_backend.py, a fault injector named as
such) ends every third sequence with half its tokens; the soak's own load,
pause (abort / keep) → update → resume included, runs a few seconds. On
fe0cb18 the soak never compared the tokens it got with max_tokens: this run
passed its token checks there. The checker's classification is unit-tested
below without sockets."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import token_check as TC
from tests.cluster import run_module


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_truncated_answer_fails_the_soak(tmp_path: Path) -> None:
    argv = [
        "-m", "bench.soak", "--minutes", "0.1", "--backend", "tests.truncating_backend:factory",
        "--concurrency", "4", "--control-every-s", "2", "--sample-every-s", "1", "--heartbeat-interval-s", "2",
        "--no-plot",
    ]  # fmt: skip
    rc, log = run_module(argv, 140, ROLLOUT_BUS_BENCH_OUT=str(tmp_path), ROLLOUT_BUS_LOG_LEVEL="WARNING")
    doc = json.loads((tmp_path / "soak.json").read_text())
    assert rc == 1 and doc["verdict"] == "FAIL" and not doc["ok"], log[-4000:]
    assert doc["criteria"]["tokens_exact"] is False
    tc = doc["token_checks"]
    assert tc["truncated"] > 0, tc
    # only what the backend did: cut short, still finished "length", in order, the null series' tokens
    assert tc["duplicated"] == tc["out_of_order"] == tc["wrong_finish"] == tc["wrong_tokens"] == 0, tc
    assert sum(tc["checked"].values()) > tc["truncated"], tc  # the other requests were checked and passed
    assert {"generate", "stream"} <= set(tc["by_kind"]), tc
    assert "truncated" in log


def _ch(i: int, toks: list[int], version: int = 0, finish: str | None = None, restarts: int = 0) -> SimpleNamespace:
    return SimpleNamespace(
        sample_index=i, token_ids=toks, weight_version=version, finish_reason=finish, restarts=restarts
    )


def test_the_checker_names_each_fault() -> None:
    want = TC.null_series(100)([5, 9], 4)
    assert want == [10, 11, 12, 13]
    assert TC.classify(want, 4, "length", want) == []
    assert TC.classify(want[:3], 4, "length", want) == ["truncated"]
    assert TC.classify([*want, 14], 4, "length", want) == ["duplicated"]
    assert TC.classify([10, 11, 11, 13], 4, "length", want) == ["duplicated"]
    assert TC.classify([11, 10, 12, 13], 4, "length", want) == ["out_of_order"]
    assert TC.classify([10, 11, 12, 99], 4, "length", want) == ["wrong_tokens"]
    assert TC.classify(want, 4, "stop", want) == ["wrong_finish"]


def test_a_stream_out_of_order_or_repeated_is_caught() -> None:
    ok = TC.StreamCheck(2)
    for ch in (_ch(0, [1, 2]), _ch(1, [1]), _ch(1, [2], finish="length"), _ch(0, [], finish="length")):
        ok.feed(ch)
    assert ok.done(2) == []
    sc = TC.StreamCheck(1)
    for ch in (_ch(0, [1], 2), _ch(0, [2], 1), _ch(0, [3], 2, "length"), _ch(0, [4], 2, "length"), _ch(3, [5])):
        sc.feed(ch)
    # version going back, a second final chunk, a sample index the request lacks
    assert sorted(sc.done(3)) == ["duplicated", "out_of_order", "out_of_order"]
    cut = TC.StreamCheck(1)
    cut.feed(_ch(0, [1, 2]))
    assert cut.done(2) == ["truncated"]  # no final chunk
    restarted = TC.StreamCheck(1)
    for ch in (_ch(0, [1, 2], 1), _ch(0, [7], 0, restarts=1), _ch(0, [8], 0, "length", restarts=1)):
        restarted.feed(ch)
    assert restarted.done(2) == []  # a staleness restart drops the earlier attempt's tokens
