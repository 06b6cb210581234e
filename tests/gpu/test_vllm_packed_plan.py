"""The vllm_nccl plan (trainer_bridge/transports/vllm_nccl.py `packed_plan`)
cuts buckets where vLLM's own `pack_tensors` cuts its packed chunks. It needs
vLLM importable, not a GPU (CPU tensors); it lives here because CPU CI has no
vLLM (tests/test_skyrl_broadcast.py checks the plan's arithmetic there)."""

from __future__ import annotations

import pytest

from trainer_bridge.transports.vllm_nccl import packed_plan

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]


def test_packed_plan_matches_vllms_pack_tensors() -> None:
    import torch
    from vllm.distributed.weight_transfer import packed_tensor as packed

    named = [
        (f"t{i}", torch.zeros(n, dtype=d)) for i, (n, d) in enumerate([(7, torch.bfloat16), (30, torch.float32)] * 6)
    ]
    metas, sizes = packed_plan(
        [n for n, _ in named], [str(t.dtype) for _, t in named], [list(t.shape) for _, t in named], 150
    )
    it, chunks = iter(named), []
    while (c := packed.pack_tensors(it, lambda x: x[1], 150)) is not None:
        chunks.append(c)
    assert len(chunks) > 1, "the case must cut more than once"
    assert sizes == [c.packed_tensor.numel() for c in chunks]
    assert [[m.name for m in metas if m.bucket == i] for i in range(len(sizes))] == [c.names for c in chunks]
