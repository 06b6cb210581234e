"""Packing the trainer's tensors into flat uint8 buckets on the GPU, with the
same layout as the zmq transport (`bus.tensors.plan_buckets` /
`pack_bucket`, 256-byte aligned offsets), so a `BeginWeightUpdate` is the
same for every transport. Shared by the cuda_ipc and nccl senders.

torch is imported lazily (the trainer bridge imports without it)."""

from __future__ import annotations

from typing import Any

from bus.errors import Unsupported
from bus.tensors import start_nonfinite_check


def device_of(tensors: list[Any], device: Any) -> Any:
    import torch

    if device is not None:
        return torch.device(device)
    for t in tensors:
        if t.is_cuda:
            return t.device
    if not torch.cuda.is_available():
        raise Unsupported(
            "the GPU transports send from a CUDA device and this process has none: pass CUDA tensors, "
            "or device=..., or transport='zmq'",
            field="transport",
        )
    return torch.device("cuda", torch.cuda.current_device())


def pack_fast(index: int, metas: list[Any], sizes: list[int], tensors: list[Any], device: Any, out: Any = None) -> Any:
    """bus.tensors.pack_bucket's bytes (the same layout), with the per-tensor
    copies launched as ONE torch._foreach_copy_ per dtype instead of a Python
    loop of copy_ (~300 launches for a 0.5B model). `out`: a uint8 buffer of
    at least the bucket's size to pack into (its first sizes[index] bytes)."""
    import torch

    if out is None:
        buf = torch.empty(sizes[index], dtype=torch.uint8, device=device)
    else:
        buf = out[: sizes[index]]
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


_CHECK_STREAMS: dict[Any, Any] = {}


def check_beside(named: list[tuple[str, Any]]) -> Any:
    """bus.tensors.start_nonfinite_check, launched on a stream of its own
    (ordered after the trainer's writes), so its sums run on the GPU beside
    the packs and broadcasts instead of ahead of them. The returned function
    waits for it (the nccl sender's in-band verdict)."""
    import torch

    dev = next((t.device for _, t in named if getattr(t, "is_cuda", False)), None)
    if dev is None:
        return start_nonfinite_check(named)
    stream = _CHECK_STREAMS.get(dev)
    if stream is None:
        stream = _CHECK_STREAMS[dev] = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        result = start_nonfinite_check(named)

    def wait() -> str | None:
        stream.synchronize()  # the sums are done before any other stream reads them
        return result()

    return wait


def by_bucket(metas: list[Any], tensors: list[Any], n: int) -> list[tuple[list[Any], list[Any]]]:
    """(metas, tensors) of each of the `n` buckets, in one pass: pack_fast and
    direct_source take a bucket's own lists (each scans what it is given, so
    handing them every tensor per bucket would cost buckets x tensors: 57 x
    339 at 7B, per update)."""
    parts: list[tuple[list[Any], list[Any]]] = [([], []) for _ in range(n)]
    for m, t in zip(metas, tensors, strict=True):
        ms, ts = parts[m.bucket]
        ms.append(m)
        ts.append(t)
    return parts


def direct_source(metas: list[Any], tensors: list[Any], size: int, device: Any) -> Any:
    """The bytes of a bucket (its own `metas` and `tensors`, by_bucket) as a
    view of the trainer's own tensor when the bucket is that one tensor,
    whole, contiguous and on `device` (a large parameter: an embedding or
    lm_head has a bucket of its own): broadcast from its storage, nothing
    packed. None: the bucket must be packed."""
    import torch

    if len(metas) != 1:
        return None  # empty, or two tensors share the bucket
    m, t = metas[0], tensors[0]
    if m.offset != 0 or m.nbytes != size or t.device != torch.device(device) or not t.is_contiguous():
        return None
    return t.detach().reshape(-1).view(torch.uint8)
