"""MoE routing replay (R3, issue 37 §3) on real routes: a tiny Qwen3-MoE
(8 experts, top-2, 2 layers) served by the torch backend, which reads the
routes the model took (`output_router_logits`). Every check compares against
an oracle computed HERE, in the test process, with the same weights: one
full-sequence forward whose routers' own top-k indices are captured by hooks
(no KV cache, no engine code), so an off-by-one, a duplicated or lost row
after a re-prefill, or a transposed frame all fail.

Row convention (vLLM / SGLang): row p = the routing of position p's token as
the model's input; a sequence of L tokens has L - 1 rows.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from bus import frames as F
from bus import protocol as P
from bus.errors import BadRequest
from tests.cluster import leak_checked_cluster, wait_until

MOE = dict(moe_experts=8, moe_top_k=2)
GREEDY = {"temperature": 0.0, "ignore_eos": True}
ROUTES = {**GREEDY, "return_routed_experts": True}


@pytest.fixture(scope="module")
def moe_model() -> str:
    from engine_node.tiny_model import ensure_tiny_model

    return ensure_tiny_model(**MOE)


@pytest.fixture(scope="module")
def oracle(moe_model):
    """sequence -> uint8 [len - 1, layers, top_k]: the routers' own top-k."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float32).eval()
    gates = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
    assert len(gates) == 2

    def routes(seq: list[int]) -> np.ndarray:
        got: list[torch.Tensor] = []
        hooks = [g.register_forward_hook(lambda _m, _i, out: got.append(out[2])) for g in gates]
        try:
            with torch.inference_mode():
                model(input_ids=torch.tensor([seq[:-1]]))
        finally:
            for h in hooks:
                h.remove()
        return torch.stack(got, dim=1).numpy().astype(np.uint8)  # [tokens, layers, top_k]

    return routes


@pytest.fixture(scope="module")
def module_cluster(moe_model):
    """Two torch engines serving the MoE model with routes on. The last test
    of this module kills one of them (failover)."""
    with leak_checked_cluster(
        2, backend="torch", model=moe_model, backend_options={"return_routed_experts": True}
    ) as c:
        yield c


def _check(res, prompt: list[int], oracle, *, with_prompt: bool) -> None:
    s = res.samples[0]
    want = oracle(prompt + s.token_ids)
    assert s.routed_experts.dtype == np.uint8
    assert s.routed_experts.shape == (len(s.token_ids) - 1, 2, 2)
    np.testing.assert_array_equal(s.routed_experts, want[len(prompt) :])
    if with_prompt:
        assert s.prompt_routed_experts.shape == (len(prompt), 2, 2)
        np.testing.assert_array_equal(s.prompt_routed_experts, want[: len(prompt)])
    else:
        assert s.prompt_routed_experts is None


def test_routes_equal_the_models_own_for_streamed_and_whole_requests(module_cluster, oracle):
    c = module_cluster.client()
    prompt = [11, 12, 13, 14, 15]
    # generate is not streamed to the client: the head joins the rows into one chunk
    res = c.generate(prompt, {**ROUTES, "max_tokens": 12, "routed_experts_prompt": True})
    _check(res, prompt, oracle, with_prompt=True)
    whole = c.generate([7, 8, 9], {**ROUTES, "max_tokens": 9})
    _check(whole, [7, 8, 9], oracle, with_prompt=False)
    # the chunk stream itself: rows arrive with the token that completes them
    chunks = list(c.stream([7, 8, 9], {**ROUTES, "max_tokens": 9}))
    rows = [0 if ch.routed_experts is None else len(ch.routed_experts) for ch in chunks]
    assert rows[0] == 0 and sum(rows) == 8, rows
    np.testing.assert_array_equal(
        np.concatenate([ch.routed_experts for ch in chunks if ch.routed_experts is not None]),
        whole.samples[0].routed_experts,
    )
    # prompt routes from a position on (vLLM's routed_experts_prompt_start)
    part = c.generate(prompt, {**ROUTES, "max_tokens": 4, "routed_experts_prompt": True, "routed_experts_start": 3})
    np.testing.assert_array_equal(part.samples[0].prompt_routed_experts, oracle(prompt + [0])[3:5])


def test_routes_are_off_by_default_and_cost_no_frame(module_cluster):
    c = module_cluster.client()
    res = c.generate([5, 6, 7], {**GREEDY, "max_tokens": 6})
    assert res.samples[0].routed_experts is None and res.samples[0].prompt_routed_experts is None
    assert all(ch.routed_experts is None for ch in c.stream([5, 6, 7], {**GREEDY, "max_tokens": 6}))


def test_a_session_returns_only_the_routes_it_lacks(module_cluster, oracle):
    from trainer_bridge.session import Session

    c = module_cluster.client()
    with Session(c, [3, 4, 5, 6], params={**ROUTES, "max_tokens": 5, "routed_experts_prompt": True}) as s:
        t1 = s.generate()
        assert len(t1.routed_experts) == 4 + 5 - 1  # the prompt + the turn's tokens but its last
        s.add_observation([20, 21, 22])
        t2 = s.generate()
        assert len(t2.routed_experts) == 1 + 3 + 5 - 1  # t1's last token, the observation, its own
        np.testing.assert_array_equal(s.routed_experts, oracle(s.token_ids))


def _stream_in_thread(c, prompt: list[int], params: dict, out: dict, **kw) -> threading.Thread:
    def run() -> None:
        try:
            for ch in c.stream(prompt, params, **kw):
                out["chunks"].append(ch)
        except Exception as e:  # handed to the test
            out["error"] = e

    out["chunks"] = []
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _check_stream(chunks: list, prompt: list[int], oracle) -> None:
    """The chunks' rows, joined, are the whole sequence's routes: the prompt's
    once, then every token's but the last, none lost or repeated."""
    tokens = [x for ch in chunks for x in ch.token_ids]
    want = oracle(prompt + tokens)
    got = np.concatenate([ch.routed_experts for ch in chunks if ch.routed_experts is not None])
    np.testing.assert_array_equal(got, want[len(prompt) :])
    prompt_rows = [ch.prompt_routed_experts for ch in chunks if ch.prompt_routed_experts is not None]
    assert len(prompt_rows) == 1
    np.testing.assert_array_equal(prompt_rows[0], want[: len(prompt)])


def test_routes_survive_pause_abort_and_resume(module_cluster, oracle):
    c = module_cluster.client()
    prompt = [21, 22, 23]
    out: dict = {}
    t = _stream_in_thread(c, prompt, {**ROUTES, "max_tokens": 200, "routed_experts_prompt": True}, out)
    wait_until(lambda: len(out["chunks"]) >= 5, 30, "first tokens")
    parked = sum(r.parked for r in c.pause("abort").values())
    c.resume()
    t.join(60)
    assert "error" not in out, out.get("error")
    assert parked == 1  # it was running: re-submitted as prompt + tokens so far
    _check_stream(out["chunks"], prompt, oracle)


def test_asking_for_routes_is_refused_without_the_engine_option():
    """The engine core refuses it, naming the field (no process needed)."""
    from engine_node.backend import BackendInfo
    from engine_node.request_flow import RequestFlow

    flow = RequestFlow.__new__(RequestFlow)
    flow.accepting, flow.requests, flow.engine_id = True, {}, "e0"
    flow.info = BackendInfo("torch", "m", 512, [2], max_model_len=64)
    msg = P.Generate("r1", P.SamplingParams(max_tokens=4, return_routed_experts=True))
    with pytest.raises(BadRequest) as e:
        flow.generate(b"c", msg, [1, 2, 3])
    assert e.value.field == "params.return_routed_experts"


def test_frames_round_trip_and_a_lying_shape_is_refused():
    rows = np.arange(24, dtype=np.int32).reshape(4, 3, 2) % 200
    meta = P.RoutedExperts(4, 3, 2, F.routes_dtype(200), 1)
    np.testing.assert_array_equal(F.unpack_routes(meta, F.pack_routes(rows, meta.dtype)), rows)
    assert (F.routes_dtype(256), F.routes_dtype(257), F.routes_dtype(70000)) == ("uint8", "uint16", "uint32")
    with pytest.raises(ValueError, match="routed_experts frame"):
        F.unpack_routes(P.RoutedExperts(5, 3, 2, "uint8"), F.pack_routes(rows, "uint8"))


def test_routes_survive_failover_whole_and_in_order(module_cluster, oracle):
    """Last in the module: it kills an engine of the shared cluster."""
    c = module_cluster.client()
    prompt = [31, 32, 33, 34]
    out: dict = {}
    t = _stream_in_thread(
        c, prompt, {**ROUTES, "max_tokens": 200, "routed_experts_prompt": True}, out, session_id="pin"
    )
    wait_until(lambda: len(out["chunks"]) >= 5, 30, "first tokens")
    victim = c.generate([1], {"max_tokens": 1}, session_id="pin").engine_id
    module_cluster.kill(victim)
    t.join(60)
    assert "error" not in out, out.get("error")
    assert out["chunks"][-1].engine_id != victim and c.stats()["counters"]["failovers"] >= 1
    _check_stream(out["chunks"], prompt, oracle)


def test_the_node_takes_each_row_once_up_to_the_last_token():
    """engine_node/routes.py without a backend: a re-submission (resume_len 2)
    starts at its last resumed token; rows a re-prefill repeats are dropped; a
    row past the last token waits; a gap is an error; off takes nothing."""
    from engine_node import routes
    from engine_node.requests import new_request

    shape = (2, 2, 8)
    msg = P.Generate("r", P.SamplingParams(max_tokens=8, return_routed_experts=True), resume_len=2)
    req = new_request(b"c", msg, [1, 2, 3, 40, 41], 0.0)  # base prompt [1, 2, 3], resumed [40, 41]
    s = req.samples[0]
    routes.start(req, s)
    assert s.routes_pos == 4
    rows = np.arange(6 * 4).reshape(6, 2, 2) % 8  # positions 0..5: a re-prefill's whole sequence
    s.tokens.append(42)  # the step's new token: positions 0..5 exist, 0..4 were inputs
    assert routes.take(req, s, rows, 0, shape) is None
    meta, frame = routes.frame(s, shape)
    assert (meta.rows, meta.prompt_rows, meta.dtype) == (1, 0, "uint8") and frame == rows[4].astype(np.uint8).tobytes()
    assert routes.frame(s, shape) is None  # sent once
    assert "skip positions 5..6" in routes.take(req, s, rows[:1], 7, shape)
    off = new_request(b"c", P.Generate("o", P.SamplingParams(max_tokens=8)), [1, 2, 3], 0.0)
    routes.start(off, off.samples[0])
    assert routes.take(off, off.samples[0], rows, 0, shape) is None and routes.frame(off.samples[0], shape) is None
