"""The `null` backend (engine_node/backends/null_backend.py) as a registered
backend: found by name, its token series, resumption, stop ids, and a weight
update that validates what it was told. End to end (real engine node
processes) it is exercised by test_auth, test_faults, test_prefix_placement
and the router benches' dry runs."""

from __future__ import annotations

import pytest

from bus.protocol import SamplingParams, TensorMeta
from engine_node.backend import BACKENDS, BackendError, SeqRequest, load_backend
from engine_node.backends.null_backend import NULL_BACKEND, NullBackend


def _seq(sid: str, prompt: list[int], n: int, **params: object) -> SeqRequest:
    return SeqRequest(seq_id=sid, prompt=prompt, params=SamplingParams(**params), max_new_tokens=n)  # type: ignore[arg-type]


def test_registered_by_name() -> None:
    assert NULL_BACKEND == "null" and "null" in BACKENDS
    b = load_backend("null", "null", vocab="100", tokens_per_step="2")
    assert isinstance(b, NullBackend) and b.info().backend == "null" and b.info().vocab_size == 100


def test_unknown_option_names_it() -> None:
    with pytest.raises(BackendError, match="bogus"):
        load_backend("null", "null", bogus=1)


def test_series_streams_and_resumes() -> None:
    b = NullBackend(vocab=50, tokens_per_step=3)
    b.add(_seq("a", [10], 5))
    first = b.step()
    assert [(o.token_ids, o.finish_reason) for o in first] == [([11, 12, 13], None)]
    assert [(o.token_ids, o.finish_reason) for o in b.step()] == [([14, 15], "length")]
    assert not b.has_work()
    # a resumed sequence (prompt ends with its output so far) continues the series
    b.add(_seq("a2", [10, 11, 12, 13], 2))
    assert b.step()[0].token_ids == [14, 15]


def test_stop_ids_and_freeze() -> None:
    b = NullBackend(vocab=50)
    b.add(_seq("s", [5], 10, stop_token_ids=[8]))
    b.add(_seq("f", [20], 2))
    b.freeze(["f"])
    outs = b.step()
    assert [(o.seq_id, o.token_ids, o.finish_reason) for o in outs] == [("s", [6, 7, 8], "stop")]
    b.thaw(["f"])
    assert b.step()[0].token_ids == [21, 22]


def test_weight_update_checks_sizes() -> None:
    b = NullBackend()
    bad = TensorMeta(name="w", dtype="float32", shape=[2, 2], bucket=0, offset=0, nbytes=15)
    op = b.begin_weight_update("u1", "zmq", [bad], {})
    assert op.future.exception() is not None and "nbytes" in str(op.future.exception())
    assert b.receive_weights([]).future.exception() is not None  # no GPU transports
    assert b.commit_weight_update().future.exception() is not None  # nothing begun
