"""Issue 34 row 3: an engine's weight socket takes bytes for the open update
only from that update's senders. Every token holder passes its handshake (the
CLIENT role); the credential of a sender is the update's secret, minted by
the head at the begin, returned to the opener alone and handed to the engines
in the begin (bus/protocol_weights.py, engine_node/sender_check.py).

On main 4079a43 a second token holder (not the opener) read the open update's
id from `weight_updates` and sent each engine a forged WeightBucket(update_id,
0): acked ok; the trainer's real bucket 0 was then refused as a duplicate and
its update aborted. Now the forgery is refused naming `sender_secret`,
counted, logged at a bounded rate, and the real update commits untouched.
"""

from __future__ import annotations

import types

import pytest
import torch
import zmq

from bus import protocol as P
from bus.codec import Codec
from bus.errors import BadRequest, ControlError, Unauthorized
from engine_node.sender_check import check_sender
from tests.test_multi_sender import _perturbed  # the same perturbed tiny model as the multi-sender tests

pytestmark = pytest.mark.timeout(150)

GREEDY = {"max_tokens": 8, "temperature": 0.0}
PROMPT = [21, 22, 23, 24]


def _forge(cl, address: str, msgs: list[tuple[object, list[bytes]]]) -> list[P.WeightBucketAck]:
    """A second token holder's raw DEALER on an engine's weight socket: its
    handshake passes (the CLIENT role's credential); one ack per message."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    cl.credential().apply(s, None)
    s.connect(address)
    codec, acks = Codec(), []
    try:
        for msg, bufs in msgs:
            s.send_multipart(codec.encode(msg, bufs))
            assert s.poll(10_000), f"no ack for a forged {type(msg).__name__} from {address}"
            ack, _ = codec.decode(s.recv_multipart())
            acks.append(ack)
    finally:
        s.close(linger=0)
        ctx.term()
    return acks


def test_another_token_holder_cannot_feed_or_abort_the_open_update(cluster_factory, tiny_model):
    cl = cluster_factory(2, engine_args=["--prepare-ttl-s", "120"])
    c = cl.client(control_timeout_s=30)
    mallory = cl.client(control_timeout_s=30)  # holds the token, did not open the update
    c.wait_ready(2, 60)
    before = c.generate(PROMPT, GREEDY).token_ids
    v0 = c.health()["weight_version"]
    ref = _perturbed(tiny_model, seed=5)
    named = [(k, p.detach()) for k, p in ref.named_parameters()]
    meta = P.TensorMeta(named[0][0], "float32", [2], 0, 0, 8)
    with c.weight_update(senders=1, bucket_bytes=1 << 15) as upd:
        uid, secret = upd.update_id, upd.sender_secret
        assert len(secret) >= 32, "128 bits at least"
        # What the stranger sees: the update id (token holders do), never the secret.
        ups = mallory._call(mallory._aclient._query("weight_updates", P.WeightUpdatesView))
        seen = [mallory.health(), mallory.engines(), P.as_dict(ups)]
        assert uid in str(seen[2]) and secret not in str(seen)
        forged = [
            (P.WeightBucket(uid, 0, metas=[meta]), [b"\0" * 8]),  # no secret (the probe)
            (P.WeightBucket(uid, 0, metas=[meta], sender_secret="0" * 32), [b"\0" * 8]),  # a guess
            (P.WeightSenderEnd(uid, 0, 0), []),  # "sender 0 sent nothing": would void the real part
        ]
        for e in c.engines():
            acks = _forge(cl, e["weight_address"], forged)
            assert [(a.ok, a.field) for a in acks] == [(False, "sender_secret")] * 3, acks
            assert all(secret not in (a.error or "") and "sender secret" in (a.error or "") for a in acks)
        # The same through the client API: the id alone, or a wrong secret, makes no sender.
        with pytest.raises(BadRequest) as no_secret:
            mallory.weight_sender(uid, 0)
        assert no_secret.value.field == "sender_secret"
        with pytest.raises(ControlError) as wrong:
            mallory.weight_sender(uid, 0, sender_secret="f" * 32).send(iter(named[:1]))
        assert {f.field for f in wrong.value.errors.values()} == {"sender_secret"}
        # A GPU part (out-of-band bytes) through the head: refused there, nothing published.
        with pytest.raises(Unauthorized) as part:
            mallory.control(P.ReceiveWeights(uid, sender=0))
        assert part.value.field == "sender_secret" and secret not in str(part.value)
        upd.sender(0).send(iter(named))  # the real sender, untouched by all of the above
    assert {e: r["weight_version"] for e, r in upd.results.items()} == {"e0": v0 + 1, "e1": v0 + 1}
    with torch.no_grad():
        want = ref.generate(torch.tensor([PROMPT]), max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    got = [c.generate(PROMPT, GREEDY, session_id=f"s{i}") for i in range(8)]
    assert {tuple(g.token_ids) for g in got} == {tuple(want[0, len(PROMPT) :].tolist())} != {tuple(before)}
    stats = c.control(P.Stats())
    for eid, r in stats.items():  # counted per kind (3 buckets: 2 raw + mallory's sender's first; 1 end)
        refusals = r.detail["timings"]["weight_refusals"]
        assert refusals.get("weight_bucket_refused", 0) >= 3 and refusals.get("weight_sender_end_refused") == 1, (
            eid,
            refusals,
        )
    for name in ("head", "e0", "e1"):
        text = cl.log(name)
        assert secret not in text, f"the sender secret is in {name}'s log"
    assert 1 <= cl.log("e0").count("weight_sender_refused") <= 2, "logged at a bounded rate (one line per interval)"


def _open(secret: str, uid: str = "h.1") -> types.SimpleNamespace:
    """The shape check_sender reads of engine_node.weight_update.WeightUpdate."""
    return types.SimpleNamespace(update_id=uid, begin=P.BeginWeightUpdate(uid, "zmq", [], [], sender_secret=secret))


def test_the_engine_check_admits_only_the_open_updates_secret() -> None:
    s = "ab" * 16
    check_sender(_open(s), "h.1", s, "e0", "bucket 0")  # the sender: admitted
    check_sender(None, "h.1", "", "e0", "bucket 0")  # no update open: the transaction refuses it, not this
    check_sender(_open(s), "h.2", "", "e0", "bucket 0")  # another id: likewise (it aborts nothing open)
    for bad, why in (("", "no sender secret"), ("ab" * 15 + "ac", "a wrong sender secret"), (s[:-1], "wrong")):
        with pytest.raises(Unauthorized, match=why) as e:
            check_sender(_open(s), "h.1", bad, "e0", "bucket 0")
        assert e.value.field == "sender_secret" and s not in e.value.message
    with pytest.raises(Unauthorized):  # a begin that carried none admits nothing (fail closed)
        check_sender(_open(""), "h.1", "", "e0", "bucket 0")


def test_the_head_mints_a_secret_per_update_and_refuses_a_part_without_it() -> None:
    from router_node.cluster_state import ClusterWeights

    cw = ClusterWeights(incarnation="h")
    txn = cw.begin(P.BeginWeightUpdate("h.1", "cuda_ipc", [], [], senders=2, streamed=True), ["e0"], client=b"a", now=0)
    assert len(txn.sender_secret) == 32 and txn.sender_secret not in repr(txn) + str(cw.open_updates())
    with pytest.raises(Unauthorized) as e:
        cw.on_control(P.ReceiveWeights("h.1", sender=1, sender_secret="x" * 32), ["e0"])
    assert e.value.field == "sender_secret" and cw.current is txn and txn.decision is None  # nothing changed
    cw.on_control(P.ReceiveWeights("h.1", sender=1, sender_secret=txn.sender_secret), ["e0"])
    cw.decide_abort(txn, "test")
    nxt = cw.begin(P.BeginWeightUpdate("h.2", "zmq", [], []), ["e0"], client=b"a", now=1)
    assert nxt.sender_secret != txn.sender_secret


def test_the_head_and_the_engine_share_one_fail_closed_check() -> None:
    """bus/sender_secret.py is the one comparison: an unminted secret ("")
    matches nothing, not even "" (the head's copy used to compare "" == "")."""
    from bus.sender_secret import new_sender_secret, proves_sender_secret
    from router_node.cluster_state import WeightTxn, check_sender_secret

    s = new_sender_secret()
    assert len(s) == 32 and s != new_sender_secret()
    assert proves_sender_secret(s, s) and not proves_sender_secret("", "") and not proves_sender_secret(s, "")
    unminted = WeightTxn("h.1", "model", ["e0"], transport="cuda_ipc")
    with pytest.raises(Unauthorized, match="no sender secret") as e:
        check_sender_secret(unminted, "", "receive_weights")
    assert e.value.field == "sender_secret"


def test_only_the_updates_senders_may_prepare_commit_or_abort_it() -> None:
    """The helper's finding on i34-sender: any token holder could abort (or
    prepare) another client's open update by naming its id (`weight_updates`
    shows it). Now the opener's connection, or a client proving the sender
    secret (a rank in another process, the opener after a reconnect), may."""
    from router_node.cluster_state import ClusterWeights

    cw = ClusterWeights(incarnation="h")
    txn = cw.begin(P.BeginWeightUpdate("h.1", "zmq", [], []), ["e0"], client=b"opener", now=0)
    for op in (P.AbortWeightUpdate("h.1"), P.PrepareWeights("h.1"), P.AbortWeightUpdate("h.1", sender_secret="y" * 32)):
        with pytest.raises(Unauthorized) as e:
            cw.on_control(op, ["e0"], client=b"someone-else")
        assert e.value.field == "sender_secret" and txn.decision is None and cw.current is txn
    cw.on_control(P.PrepareWeights("h.1"), ["e0"], client=b"opener")  # the opener's own connection
    cw.on_control(P.PrepareWeights("h.1", sender_secret=txn.sender_secret), ["e0"], client=b"rank-1")
    cw.on_control(P.AbortWeightUpdate("h.1", sender_secret=txn.sender_secret), ["e0"], client=b"rank-1")
    assert txn.decision == "abort"


def test_another_token_holder_cannot_commit_or_abort_an_update_over_the_wire(cluster_factory) -> None:
    cl = cluster_factory(1, backend="null", model="null")
    cl.wait_ready(1, 30)
    trainer, other = cl.client(), cl.client()
    open_updates = lambda: other._call(other._aclient._query("weight_updates", P.WeightUpdatesView))
    upd = trainer.weight_update()
    upd.__enter__()
    try:
        for op in (P.AbortWeightUpdate(upd.update_id), P.FinishWeightUpdate(upd.update_id)):
            with pytest.raises(Unauthorized) as e:
                other.control(op)
            assert e.value.field == "sender_secret" and upd.sender_secret not in str(e.value)
        assert list(open_updates().updates) == [upd.update_id]  # still open, untouched
    finally:
        upd.abort()  # the opener may
    assert open_updates().updates == {}
