"""The trainer's zero-copy layout id (trainer_bridge/transports/one_trip.py
`layout_id`) is found again by identity when the plan and handle caches hand
the same objects; equal new objects give the same id, any change another."""

from __future__ import annotations

import hashlib

import msgspec

from bus.protocol import TensorMeta
from trainer_bridge.transports import one_trip


def _layout(n=339, handle=b"h"):
    metas = [TensorMeta(f"t{i}", "bfloat16", [4, 8], i, 0, 64) for i in range(n)]
    return metas, [64] * n, [handle + bytes([i % 256]) * 300 for i in range(n)]


def test_layout_id_is_found_again_by_identity_and_changes_with_the_layout(monkeypatch):
    metas, sizes, handles = _layout()
    first = one_trip.layout_id(metas, sizes, handles)
    hashed = []
    real = hashlib.blake2b
    monkeypatch.setattr(one_trip.hashlib, "blake2b", lambda **kw: hashed.append(1) or real(**kw))
    assert one_trip.layout_id(list(metas), list(sizes), list(handles)) == first
    assert hashed == [], "the same objects: no encode, no hash"
    m2, s2, h2 = _layout()
    assert one_trip.layout_id(m2, s2, h2) == first, "equal new objects: the same id"
    assert len(hashed) == 1
    h3 = list(h2)
    h3[5] = b"moved"
    assert one_trip.layout_id(m2, s2, h3) != first
    assert one_trip.layout_id(m2, [64] * 338 + [128], h2) != first
    m4 = list(m2)
    m4[0] = msgspec.structs.replace(m4[0], shape=[8, 4])
    assert one_trip.layout_id(m4, s2, h2) != first
    assert one_trip.layout_id(m2, s2, h2) == first
