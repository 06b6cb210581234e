"""The weights SkyRL's senders hand `RolloutBusEngine` (trainer_bridge/skyrl/engine.py),
as (name, tensor) pairs: a chunk of SkyRL's CUDA IPC sender (one packed buffer
shared by IPC handle) or the tensors of `update_named_weights`."""

from __future__ import annotations

import base64
import pickle
from collections.abc import Iterable, Mapping
from typing import Any

from bus.errors import BadRequest, Unsupported


def has_cuda() -> bool:
    try:
        import torch  # optional here: a trainer without torch sends over zmq

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def gpu_uuid() -> str:
    """This process's GPU's uuid as SkyRL keys IPC handles ("" without CUDA)."""
    if not has_cuda():
        return ""
    import torch

    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)


def rebuild_shared(fn: Any, args: tuple[Any, ...]) -> Any:
    """A tensor from torch's `reduce_tensor` pair. Hazard: SkyRL's sender and
    this adapter share one process (the policy worker calls the engine client
    it holds), and CUDA refuses to open an IPC handle in the process that
    exported it (cuIpcOpenMemHandle: invalid device context). torch keeps the
    exporting process's storage in `shared_cache` under the bare handle
    (reduce_tensor), while rebuild_cuda_tensor looks for (handle, offset), so
    the local storage is found here first; another process's handle (the
    cross-process case) is opened by torch as usual."""
    try:
        from torch.multiprocessing import reductions
    except ImportError:
        return fn(*args)
    if fn is reductions.rebuild_cuda_tensor:
        _cls, size, stride, offset, _scls, dtype, _dev, handle = args[:8]
        ref = reductions.shared_cache.get(handle)
        if ref is not None and not ref.expired():
            import torch

            storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
            typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
            return torch._utils._rebuild_tensor(typed, offset, size, stride)
    return fn(*args)


def unpack_ipc_chunk(update_info: Mapping[str, Any], out: list[tuple[str, Any]]) -> int:
    """Append one chunk's tensors to `out` (copies: the sender frees the packed
    buffer when the call returns); the number of tensors. The chunk:
    `ipc_handles_pickled` (base64 of a pickled {GPU uuid: (rebuild_fn, args)}
    for ONE packed buffer) + names / dtype_names / shapes / sizes (elements per
    tensor). The handle for this process's GPU is rebuilt (rebuild_shared: the
    exporter's own storage when this process made it); CPU tensors' handles
    (torch's reduce_tensor) work too."""
    try:
        handles = pickle.loads(base64.b64decode(update_info["ipc_handles_pickled"]))
        names, shapes, sizes = list(update_info["names"]), list(update_info["shapes"]), list(update_info["sizes"])
    except KeyError as e:
        raise BadRequest(f"update_info lacks {e.args[0]!r}", field=f"update_info.{e.args[0]}") from None
    if not (len(names) == len(shapes) == len(sizes)) or not handles:
        raise BadRequest("names, shapes and sizes differ in length (or no handle)", field="update_info")
    fn, args = handles.get(gpu_uuid(), next(iter(handles.values())))
    packed = rebuild_shared(fn, args)
    off = 0
    for name, shape, size in zip(names, shapes, sizes, strict=True):
        out.append((name, packed[off : off + size].view(*shape).clone()))
        off += size
    return len(names)


def named_tensors(request: Any) -> list[tuple[str, Any]]:
    if hasattr(request, "tensors") and hasattr(request, "names"):
        return list(zip(request.names, request.tensors, strict=True))
    if isinstance(request, Mapping):
        return list(request.items())
    if isinstance(request, Iterable) and not isinstance(request, (str, bytes)):
        return list(request)
    raise Unsupported(
        f"{type(request).__name__} carries no tensors: SkyRL's NCCL/IPC requests move bytes through SkyRL's own "
        "sender; rollout-bus moves them itself: pass the tensors (a WeightChunk, a dict or (name, tensor) pairs)",
        field="request",
    )
