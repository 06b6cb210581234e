"""Weight buckets: many tensors flattened into a few large byte buffers.

Both ends share the plan (`TensorMeta` list + bucket sizes), so a bucket is
raw bytes on the wire and unpacking is slicing, not parsing.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable

from bus.protocol import TensorMeta

DEFAULT_BUCKET_BYTES = 256 << 20
_ALIGN = 256  # keep every tensor's offset aligned for fast copies / dtype views


def dtype_name(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


def plan_buckets(named: Iterable[tuple[str, Any]], bucket_bytes: int = DEFAULT_BUCKET_BYTES):
    """Assign each tensor a (bucket, offset). A tensor larger than
    `bucket_bytes` gets a bucket of its own. Returns (metas, bucket_sizes, tensors)."""
    metas: list[TensorMeta] = []
    sizes: list[int] = []
    tensors: list[Any] = []
    cur = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if not sizes or (cur > 0 and cur + nbytes > bucket_bytes):
            sizes.append(0)
            cur = 0
        metas.append(TensorMeta(name, dtype_name(t), list(t.shape), len(sizes) - 1, cur, nbytes))
        tensors.append(t)
        cur += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        sizes[-1] = cur
    return metas, sizes, tensors


def pack_bucket(index: int, metas: list[TensorMeta], sizes: list[int], tensors: list[Any], device: str = "cpu"):
    """One bucket as a flat uint8 tensor (on `device`)."""
    import torch

    buf = torch.empty(sizes[index], dtype=torch.uint8, device=device)
    for m, t in zip(metas, tensors):
        if m.bucket != index:
            continue
        src = t.detach().contiguous().reshape(-1).view(torch.uint8)
        buf[m.offset : m.offset + m.nbytes].copy_(src, non_blocking=True)
    return buf


def unpack_bucket(index: int, metas: list[TensorMeta], buffer: Any) -> list[tuple[str, Any]]:
    """Views into `buffer` (bytes-like or a uint8 tensor), one per tensor of the bucket."""
    import torch

    if isinstance(buffer, torch.Tensor):
        flat = buffer
    else:
        with warnings.catch_warnings():
            # zmq frames are read-only; the backend copies what it keeps.
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(buffer, dtype=torch.uint8) if len(buffer) else torch.empty(0, dtype=torch.uint8)
    out = []
    for m in metas:
        if m.bucket != index:
            continue
        if m.offset + m.nbytes > flat.numel():
            raise ValueError(f"bucket {index} is {flat.numel()} bytes, tensor {m.name} needs {m.offset + m.nbytes}")
        dt = getattr(torch, m.dtype, None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"tensor {m.name}: unknown dtype {m.dtype!r}")
        out.append((m.name, flat[m.offset : m.offset + m.nbytes].view(dt).view(m.shape)))
    return out
