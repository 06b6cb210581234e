"""CPU tests of trainer_bridge.transports.packing (runs in CI)."""

from __future__ import annotations

import pytest
import torch

from bus.tensors import pack_bucket, plan_buckets
from trainer_bridge.transports.packing import pack_fast

pytestmark = pytest.mark.timeout(60)


def test_pack_fast_equals_pack_bucket():
    g = torch.Generator().manual_seed(0)
    named = [
        ("a", torch.randn(7, 5, generator=g).to(torch.bfloat16)),
        ("b", torch.randn(3, generator=g)),  # another dtype: its own foreach group
        ("c", torch.randn(4, 6, generator=g).to(torch.bfloat16).t()),  # not contiguous: the slow path
        ("d", torch.empty(0)),
        ("e", torch.arange(10, dtype=torch.int64)),
    ]
    metas, sizes, tensors = plan_buckets(named, 128)
    assert len(sizes) > 1
    for i in range(len(sizes)):
        want = pack_bucket(i, metas, sizes, tensors)
        got = pack_fast(i, metas, sizes, tensors, "cpu")
        # padding bytes are not part of the layout: compare the tensors' bytes only
        for m in metas:
            if m.bucket == i:
                sl = slice(m.offset, m.offset + m.nbytes)
                assert torch.equal(got[sl], want[sl]), m.name
