"""Weight buckets: many tensors flattened into a few large byte buffers.

Both ends share the plan (`TensorMeta` list + bucket sizes), so a bucket is
raw bytes on the wire and unpacking is slicing, not parsing.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

from bus.protocol import TensorMeta

DEFAULT_BUCKET_BYTES = 256 << 20

# Bytes per element of the dtype names a TensorMeta may carry (torch's names,
# without "torch."): for sizes computed where torch is not imported.
ITEMSIZE = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "float64": 8,
    "double": 8,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
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
    for m, t in zip(metas, tensors, strict=True):
        if m.bucket != index:
            continue
        src = t.detach().contiguous().reshape(-1).view(torch.uint8)
        buf[m.offset : m.offset + m.nbytes].copy_(src, non_blocking=True)
    return buf


def _meta_fields(m: Any) -> tuple[str, str, list[int], int, int, int]:
    """A TensorMeta or its list form [name, dtype, shape, bucket, offset, nbytes]."""
    if isinstance(m, (list, tuple)):
        name, dtype, shape, bucket, offset, nbytes = m
        return str(name), str(dtype), list(shape), int(bucket), int(offset), int(nbytes)
    return m.name, m.dtype, list(m.shape), int(m.bucket), int(m.offset), int(m.nbytes)


def unpack_bucket(index: int, metas: list[Any], buffer: Any) -> list[tuple[str, Any]]:
    """Views into `buffer` (bytes-like, e.g. a memoryview of a zmq frame or a
    mmap, or a flat uint8 tensor on any device), one per tensor of bucket `index`.

    Total: whatever the metas claim (offsets, sizes, dtypes, shapes), a lie is a
    ValueError naming the tensor, never a RuntimeError from torch or a view
    reaching past the buffer. A tensor whose offset is not a multiple of its
    dtype's size is copied (torch cannot view it in place); planned buckets are
    256-byte aligned, so that never happens for what plan_buckets makes."""
    import math

    import torch

    if isinstance(buffer, torch.Tensor):
        if buffer.dtype != torch.uint8 or buffer.dim() != 1:
            raise ValueError(
                f"bucket {index}: expected a flat uint8 tensor, got {buffer.dtype} of shape {list(buffer.shape)}"
            )
        flat = buffer
    else:
        try:
            view = memoryview(buffer).cast("B")
        except TypeError as e:
            raise ValueError(f"bucket {index}: not a bytes-like buffer ({type(buffer).__name__}): {e}") from None
        with warnings.catch_warnings():
            # zmq frames are read-only; the backend copies what it keeps.
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(view, dtype=torch.uint8) if len(view) else torch.empty(0, dtype=torch.uint8)
    size = flat.numel()
    out = []
    for m in metas:
        name, dtype, shape, bucket, offset, nbytes = _meta_fields(m)
        if bucket != index:
            continue
        dt = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"tensor {name}: unknown dtype {dtype!r}")
        if any((not isinstance(d, int)) or d < 0 for d in shape):
            raise ValueError(f"tensor {name}: bad shape {shape}")
        itemsize = torch.empty((), dtype=dt).element_size()
        want = math.prod(shape) * itemsize
        if nbytes != want:
            raise ValueError(f"tensor {name}: nbytes {nbytes} != {want} for shape {shape} x {dtype}")
        if offset < 0 or offset + nbytes > size:
            raise ValueError(
                f"tensor {name} needs bytes [{offset}, {offset + nbytes}) of bucket {index}, which is {size} bytes"
            )
        raw = flat[offset : offset + nbytes]
        if offset % itemsize:
            raw = raw.clone()  # a dtype view needs an aligned storage offset
        out.append((name, raw.view(dt).view(shape)))
    return out


class BucketPacker:
    """Packs tensors into buckets AS THEY ARRIVE, with plan_buckets' layout
    (a new bucket when the next tensor would overflow a non-empty one; a
    tensor larger than `bucket_bytes` gets a bucket of its own; 256-byte
    aligned offsets). `add` copies the tensor into the open bucket at once,
    so the caller may drop it: the packer holds at most one open bucket.

    `add`/`flush` return the buckets that became full: (index, metas, flat
    uint8 tensor of exactly the bucket's size). `dry=True` only plans (no
    memory, no copies; buckets come back with a None buffer) — the plan a
    BeginWeightUpdate announces is then identical to what is sent later."""

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, *, device: str = "cpu", dry: bool = False) -> None:
        self.bucket_bytes = int(bucket_bytes)
        self.device = device
        self.dry = dry
        self.index = -1  # the open bucket's index
        self.cur = 0  # bytes used in the open bucket (aligned)
        self.metas: list[TensorMeta] = []  # of the open bucket
        self.buf: Any = None
        self.open = False

    def add(self, name: str, t: Any) -> list[tuple[int, list[TensorMeta], Any]]:
        import torch

        nbytes = t.numel() * t.element_size()
        done = []
        if not self.open or (self.cur > 0 and self.cur + nbytes > self.bucket_bytes):
            done = self.flush()
            self.index += 1
            self.open, self.cur, self.metas = True, 0, []
            if not self.dry:
                self.buf = torch.empty(max(self.bucket_bytes, _aligned(nbytes)), dtype=torch.uint8, device=self.device)
        self.metas.append(TensorMeta(name, dtype_name(t), list(t.shape), self.index, self.cur, nbytes))
        if not self.dry and nbytes:
            src = t.detach().contiguous().reshape(-1).view(torch.uint8)
            self.buf[self.cur : self.cur + nbytes].copy_(src)
        self.cur += _aligned(nbytes)
        return done

    def flush(self) -> list[tuple[int, list[TensorMeta], Any]]:
        """The open bucket, if it holds anything (call once more at the end)."""
        if not self.open:
            return []
        self.open = False
        buf, self.buf = self.buf, None
        return [(self.index, self.metas, None if buf is None else buf[: self.cur])]


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def start_nonfinite_check(named: list[tuple[str, Any]]) -> Callable[[], str | None]:
    """Launch a NaN/inf check of the floating-point tensors without waiting
    for it; the returned function waits and gives the name of the first
    tensor holding a NaN or inf (None: all finite). GPU tensors: one fp32 sum
    per tensor, queued on the device (NaN and inf survive a sum), then one
    host sync for all of them — on an H200 a 7.6B model's 339 tensors take
    5.6 ms this way against 7.5 for a max-abs pass and far more one tensor and
    one sync at a time. The caller overlaps it with a round trip (the begin of
    a GPU update). A sum that overflows from finite values, or a dtype
    without a sum kernel (fp8), falls back to the exact check, which also
    names the tensor."""
    import torch

    groups: dict[Any, list[Any]] = {}
    try:
        for _name, t in named:
            if t.is_floating_point() and t.numel():
                groups.setdefault(t.device, []).append(t.sum(dtype=torch.float32))
        sums = [torch.stack(v) for v in groups.values()]
    except (RuntimeError, TypeError, NotImplementedError):
        sums = None

    def result() -> str | None:
        if sums is not None and all(bool(torch.isfinite(v).all()) for v in sums):
            return None
        return _first_nonfinite_exact(named)

    return result


def first_nonfinite(named: list[tuple[str, Any]]) -> str | None:
    """The name of the first floating-point tensor holding a NaN or inf (None:
    all finite): start_nonfinite_check, waited for at once."""
    return start_nonfinite_check(named)()


def _first_nonfinite_exact(named: list[tuple[str, Any]]) -> str | None:
    import torch

    for name, t in named:
        if not t.is_floating_point():
            continue
        try:
            ok = bool(torch.isfinite(t).all())
        except (RuntimeError, TypeError):  # dtypes without isfinite on this device (fp8)
            ok = bool(torch.isfinite(t.float()).all())
        if not ok:
            return str(name)
    return None
