"""The backend's side of a weight update: one record per update, validation
against the checkpoint, and the zmq transport's shared-memory staging.

Where the bytes go, per transport (the workers' side is vllm/worker_ext):
- cuda_ipc: nowhere here. The receive only keeps the handles; the commit is ONE
  worker call that maps the trainer's buckets, validates them, writes the
  parameters from those views and drops the maps; the trainer keeps its buckets
  alive until the commit's ack (trainer_bridge.transports.cuda_ipc documents that).
- nccl: workers receive into their own staging buffers at receive (the begin's
  metas travel with that call), write the parameters at commit.
- zmq: `stage_bucket` copies each bucket's raw bytes, once, into one shared
  memory file sized at begin (sum of bucket_sizes); at commit every worker maps
  it, copies each bucket to its GPU and loads from views (bus.tensors.unpack_bucket).
  The file is removed on commit, abort and close. No torch.save / torch.load.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
import tempfile
import uuid
from typing import Any

import structlog

from bus.tensors import _ALIGN, unpack_bucket
from bus.transport import Transport

TRANSPORTS = tuple(t.value for t in Transport)

log = structlog.get_logger("rollout_bus.vllm_weights")


def meta_list(t: Any) -> list[Any]:
    """A TensorMeta (or its dict form) as the list the workers take."""
    if isinstance(t, dict):
        return [t["name"], t["dtype"], list(t["shape"]), int(t["bucket"]), int(t["offset"]), int(t["nbytes"])]
    if isinstance(t, (list, tuple)):
        return list(t)
    return [t.name, t.dtype, list(t.shape), int(t.bucket), int(t.offset), int(t.nbytes)]


def validate(
    metas: list[list[Any]], sizes: list[int], shapes: dict[str, list[int]], tied: bool, model: str
) -> tuple[str, str] | None:
    """(tensor name, why) for the first bad tensor, else None. Checks what a
    worker would trip on: dtype, nbytes vs shape, bucket bounds, and (when the
    checkpoint's shapes are known) that the name is a weight of the model with
    the same shape."""
    import torch

    seen: set[str] = set()
    for name, dtype, shape, bucket, offset, nbytes in metas:
        dt = getattr(torch, str(dtype).removeprefix("torch."), None)
        if not isinstance(dt, torch.dtype):
            return name, f"tensor {name!r}: unknown dtype {dtype!r}"
        if any((not isinstance(d, int)) or d < 0 for d in shape):
            return name, f"tensor {name!r}: bad shape {shape}"
        if nbytes != math.prod(shape) * torch.empty((), dtype=dt).element_size():
            return name, f"tensor {name!r}: nbytes {nbytes} does not match shape {shape} x {dtype}"
        if not 0 <= bucket < len(sizes):
            return name, f"tensor {name!r}: bucket {bucket} of {len(sizes)}"
        if offset < 0 or offset + nbytes > sizes[bucket]:
            return (
                name,
                f"tensor {name!r}: bytes [{offset}, {offset + nbytes}) outside bucket {bucket} of {sizes[bucket]} bytes",
            )
        if name in seen:
            return name, f"tensor {name!r} appears twice"
        seen.add(name)
        if not shapes:
            continue
        if name not in shapes:
            if tied and name == "lm_head.weight":
                continue
            return name, f"tensor {name!r} is not a weight of {model}"
        if list(shape) != shapes[name]:
            return name, f"tensor {name!r}: shape {list(shape)} != the model's {shapes[name]}"
    return None


def derive_sizes(metas: list[list[Any]]) -> list[int]:
    """Bucket sizes as bus.tensors.plan_buckets makes them (end of the last
    tensor, 256-aligned), for a begin that did not carry bucket_sizes."""
    n = 1 + max((m[3] for m in metas), default=-1)
    sizes = [0] * n
    for m in metas:
        sizes[m[3]] = max(sizes[m[3]], (m[4] + m[5] + _ALIGN - 1) // _ALIGN * _ALIGN)
    return sizes


def checkpoint_shapes(model: str) -> dict[str, list[int]]:
    """Tensor names/shapes of the model's checkpoint (safetensors headers only); {} if unknown."""
    path = model
    if not os.path.isdir(path):
        try:
            from huggingface_hub import snapshot_download

            path = snapshot_download(model, local_files_only=True, allow_patterns=["*.safetensors", "*.json"])
        except Exception as exc:  # not in the local cache: the plan learns shapes from the engine instead
            log.debug("checkpoint_shapes_unknown", model=model, error=repr(exc))
            return {}
    shapes: dict[str, list[int]] = {}
    try:
        from safetensors import safe_open

        for fn in sorted(os.listdir(path)):
            if fn.endswith(".safetensors"):
                with safe_open(os.path.join(path, fn), framework="pt") as f:
                    for k in f.keys():
                        shapes[k] = list(f.get_slice(k).get_shape())
    except Exception as exc:  # an unreadable header: same fallback as an unknown checkpoint
        log.debug("checkpoint_shapes_unreadable", path=path, error=repr(exc))
        return {}
    return shapes


def _shm_dir() -> str:
    d = "/dev/shm"
    return d if os.path.isdir(d) and os.access(d, os.W_OK) else tempfile.gettempdir()


class ShmStage:
    """One shared-memory file holding every bucket of a zmq update, back to back."""

    def __init__(self, sizes: list[int], tag: str) -> None:
        self.sizes = [int(s) for s in sizes]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.total = sum(self.sizes)
        self.path = os.path.join(_shm_dir(), f"rollout_bus_{os.getpid()}_{tag}")
        self.staged: set[int] = set()
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, self.total)
            self.mm = mmap.mmap(fd, self.total) if self.total else None
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)

    def write(self, bucket: int, data: memoryview, metas: list[list[Any]]) -> None:
        if not 0 <= bucket < len(self.sizes):
            raise ValueError(f"bucket {bucket} of {len(self.sizes)}")
        view = memoryview(data).cast("B")
        if len(view) != self.sizes[bucket]:
            raise ValueError(f"bucket {bucket} is {len(view)} bytes, the plan says {self.sizes[bucket]}")
        unpack_bucket(bucket, metas, view)  # total: a lying meta is a ValueError naming the tensor
        if self.mm is not None and len(view):
            off = self.offsets[bucket]
            self.mm[off : off + len(view)] = view  # the one copy
        self.staged.add(bucket)

    def missing(self) -> list[int]:
        return [b for b in range(len(self.sizes)) if b not in self.staged]

    def spec(self) -> dict[str, Any]:
        return {"path": self.path, "offsets": self.offsets}

    def close(self) -> None:
        mm, self.mm = self.mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # a view still exported: the mapping goes with the process
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


@dataclasses.dataclass
class Part:
    """One sender's part of a multi-sender GPU update, validated and appended
    to the update (its bucket numbers shifted past the parts before it)."""

    what: str  # the op's name in errors: "receive_part(sender N)"
    metas: list[list[Any]]
    sizes: list[int]
    first: int  # the update's bucket index of the part's bucket 0
    handles: list[Any]
    args: dict[str, Any]


@dataclasses.dataclass(eq=False)
class WeightUpdate:
    """The one record of an update in the backend (keyed by the trainer's id)."""

    update_id: str
    transport: str
    metas: list[list[Any]]
    sizes: list[int]
    args: dict[str, Any]
    uid: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:12])
    stage: ShmStage | None = None  # zmq
    received: bool = False  # cuda_ipc / nccl
    handles: list[Any] = dataclasses.field(default_factory=list)  # cuda_ipc: opened by the commit's worker call
    workers_know: bool = False  # a worker call about this update was sent (nccl receive): abort must tell them
    keeps: Any = None  # cuda_ipc keep_maps: the vllm/weight_reuse.KeptIpc its commit asks the workers to keep

    def close(self) -> None:
        if self.stage is not None:
            self.stage.close()
            self.stage = None
