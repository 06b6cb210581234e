"""Packing the trainer's tensors into flat uint8 buckets on the GPU, with the
same layout as the zmq transport (`bus.tensors.plan_buckets` /
`pack_bucket`, 256-byte aligned offsets), so a `BeginWeightUpdate` is the
same for every transport. Shared by the cuda_ipc and nccl senders.

torch is imported lazily (the trainer bridge imports without it)."""

from __future__ import annotations

from typing import Any


def device_of(tensors: list[Any], device: Any) -> Any:
    import torch

    if device is not None:
        return torch.device(device)
    for t in tensors:
        if t.is_cuda:
            return t.device
    return torch.device("cuda", torch.cuda.current_device())


def pack_fast(index: int, metas: list[Any], sizes: list[int], tensors: list[Any], device: Any) -> Any:
    """bus.tensors.pack_bucket's bytes (the same layout), with the per-tensor
    copies launched as ONE torch._foreach_copy_ per dtype instead of a Python
    loop of copy_ (~300 launches for a 0.5B model)."""
    import torch

    buf = torch.empty(sizes[index], dtype=torch.uint8, device=device)
    groups: dict[Any, tuple[list[Any], list[Any]]] = {}
    typed: dict[Any, Any] = {}  # dtype -> the whole bucket viewed as it (buckets are 256-byte aligned)
    for m, t in zip(metas, tensors, strict=True):
        if m.bucket != index or m.nbytes == 0:
            continue
        if t.device != buf.device or not t.is_contiguous() or m.offset % t.element_size():
            src = t.detach().contiguous().reshape(-1).view(torch.uint8)
            buf[m.offset : m.offset + m.nbytes].copy_(src, non_blocking=True)
            continue
        base = typed.get(t.dtype)
        if base is None:
            base = typed[t.dtype] = buf[: buf.numel() // t.element_size() * t.element_size()].view(t.dtype)
        a = m.offset // t.element_size()
        g = groups.setdefault(t.dtype, ([], []))
        g[0].append(base[a : a + t.numel()])
        g[1].append(t.detach().view(-1))
    for dsts, srcs in groups.values():
        torch._foreach_copy_(dsts, srcs)
    return buf


def record_written(named: list[tuple[str, Any]]) -> Any:
    """A CUDA event after everything queued so far on the current stream of
    the tensors' GPU (None: no GPU tensor): what share_in_place waits for."""
    import torch

    dev = next((t.device for _, t in named if getattr(t, "is_cuda", False)), None)
    if dev is None:
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(dev))
    return ev
