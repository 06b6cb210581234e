"""Receive straight into the parameters: a per-model copy plan learned from
the model's own `load_weights`, replayed as device copies on later updates.

vLLM's `model.load_weights` spends 11-14 ms of per-tensor Python on a 0.5B
model (name remapping, stacked q/k/v and gate/up shards, TP narrowing), every
update, to do what is in the end a fixed set of copies: checkpoint tensor
slice -> parameter slice. `record` runs `load_weights` ONCE under a torch
dispatch mode that captures, and does NOT perform, every write to a parameter
(or buffer) of the model:

  - `copy_(dst, src)` with `dst` a view of a parameter and `src` a view of one
    incoming tensor: a COPY (parameter, dst geometry) <- (name, src geometry);
  - `fill_` / `zero_` of a parameter view with a constant: a FILL (vocab
    padding rows, for one);
  - anything else that writes a parameter (arithmetic, a copy from a tensor
    derived from the input, out= ops): the parameter is TAINTED, and every
    name that wrote it is loaded the normal way (`load_weights`), forever.

A name that produced no recorded write at all is asked about alone: when
`load_weights` of just that name writes nothing and reports nothing loaded
(the tied `lm_head.weight` Qwen2 skips) it is SKIPPED; otherwise (a loader
keeping tensors in Python state, say) it is left to `load_weights` every time.

`verify` then checks the plan against the truth: after the real
`load_weights` of the same update ran, every planned destination must hold
exactly (bit for bit) what the plan would write; a name whose copies disagree
goes to the fallback set. `apply` replays the plan (a `Replay`: the copies
grouped for launch once, cached by the worker with the source views): a copy
of at least `BIG_COPY_BYTES` is its own `copy_` (the dedicated copy kernel moves
large tensors faster than `_foreach_copy_`'s chunked one: bench/gpu/plan_copy.py),
the rest go in ONE `torch._foreach_copy_` per device (one kernel per few tensors
instead of ~300 Python loader calls), single copies for broadcasts, fills after.
Where two destinations overlap the plan replays strictly in recorded order instead.

Hazards:
- Python side effects of a loader (flags on a layer, counters kept by vLLM's
  layerwise reload for online-quantized models) are invisible here. The worker
  extension never plans a quantized model (`plannable`); fp8 re-quantization
  is vllm/fp8's, run from the post-load hook.
- The plan holds views of the live parameters. `still_valid` checks that every
  parameter is still its module's and still at the address it had when recorded
  (a parameter replaced or re-allocated invalidates the plan; it is then
  recorded again). It runs on every update, so it is a few C-level list
  compares, not a Python loop over the parameters.

Nothing here imports vLLM: the CPU tests run it against a small vLLM-like
module with stacked parameters and TP-style narrowing.
"""

from __future__ import annotations

import bisect
import dataclasses
import operator
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# A copy this large (bytes) is launched as its own copy_ (bench/gpu/plan_copy.py,
# run 28: copy_ for tensors >= 16 MiB + one foreach for the rest 0.65 ms against
# 0.76 ms for one foreach, 0.5B layout on an H200).
BIG_COPY_BYTES = 16 << 20

_aten = torch.ops.aten
_FILLS = {_aten.fill_.Scalar, _aten.zero_.default}
_COPY = _aten.copy_.default


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, last byte + 1) of a view, in its storage's address space."""
    if t.numel() == 0:
        p = t.data_ptr()
        return p, p
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True) if s > 0)
    p = t.data_ptr()
    return p, p + span * t.element_size()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers: NaN == NaN, -0.0 != 0.0 (bit-exact equality)."""
    it = _INT_OF_SIZE.get(t.element_size())
    return t.view(it) if it is not None and t.is_floating_point() else t


@dataclasses.dataclass
class _Copy:
    name: str  # checkpoint name whose tensor is the source
    param: str  # destination parameter's name
    dst: torch.Tensor  # a view of the live parameter
    src_offset: int  # source geometry, in elements, relative to the name's tensor
    src_size: tuple[int, ...]
    src_stride: tuple[int, ...]
    src_dtype: torch.dtype


@dataclasses.dataclass
class _Fill:
    name: str
    param: str
    dst: torch.Tensor
    value: Any


class _Recorder(TorchDispatchMode):
    """Captures writes to the model's storages; performs none of them."""

    def __init__(self, params: dict[tuple[str, int], str]) -> None:
        super().__init__()
        self.params = params  # storage key -> parameter name
        self.raw: list[tuple[str, str, torch.Tensor, Any]] = []  # (kind, param, dst, src|value)
        self.tainted: dict[str, str] = {}  # parameter -> why

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        written = self._written(func, args, kwargs)
        if not written:
            return func(*args, **kwargs)
        hit = [(t, p) for t in written if (p := self.params.get(_storage_key(t))) is not None]
        if not hit:
            return func(*args, **kwargs)  # a scratch tensor of the loader's own
        dst, param = hit[0]
        if dst.numel() == 0:
            pass  # e.g. vocab padding of zero rows: nothing to write, nothing to plan
        elif func is _COPY and len(hit) == 1:
            self.raw.append(("copy", param, dst, args[1]))
        elif func in _FILLS and len(hit) == 1:
            value = 0 if func is _aten.zero_.default else args[1]
            self.raw.append(("fill", param, dst, value))
        else:
            for _, p in hit:
                self.tainted.setdefault(p, f"{func} writes it")
        # The write is NOT performed: the live parameters stay as they were.
        # In-place ops return their first argument; out= ops their out.
        return kwargs["out"] if "out" in kwargs else args[0]

    @staticmethod
    def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        schema = func._schema
        for i, a in enumerate(schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            v = kwargs.get(a.name) if a.kwarg_only or i >= len(args) else args[i]
            if isinstance(v, torch.Tensor):
                out.append(v)
            elif isinstance(v, (list, tuple)):
                out.extend(x for x in v if isinstance(x, torch.Tensor))
        return out


@dataclasses.dataclass
class Replay:
    """One update's planned writes, grouped for launch: the large copies one
    `copy_` each (issued first, so the GPU starts on them while the CPU
    launches the rest), then one `_foreach_copy_` per device, broadcasting
    copies, fills; or, with overlapping destinations, every write in recorded
    order. Destinations do not overlap otherwise, so the grouping cannot
    change the result."""

    n: int = 0
    big: list[tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=list)
    foreach: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = dataclasses.field(default_factory=list)
    single: list[tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=list)
    fills: list[tuple[torch.Tensor, Any]] = dataclasses.field(default_factory=list)
    ordered: list[tuple[torch.Tensor, torch.Tensor | None, Any]] | None = None

    def run(self) -> int:
        """Perform the writes. Returns the number of copies."""
        with torch.no_grad():
            if self.ordered is not None:
                for dst, src, value in self.ordered:
                    if src is not None:
                        dst.copy_(src)
                    else:
                        dst.fill_(value)
                return self.n
            for dst, src in self.big:
                dst.copy_(src)
            for dsts, srcs in self.foreach:
                torch._foreach_copy_(dsts, srcs)
            for dst, src in self.single:
                dst.copy_(src)
            for dst, value in self.fills:
                dst.fill_(value)
        return self.n


class WeightPlan:
    """The copy plan for one incoming layout (names, dtypes, shapes)."""

    def __init__(self, key: Any) -> None:
        self.key = key
        self.copies: list[_Copy] = []
        self.fills: list[_Fill] = []
        self.fallback: set[str] = set()  # names always loaded through load_weights
        self.skipped: set[str] = set()  # names load_weights itself ignores (nothing written, none loaded)
        self.why: dict[str, str] = {}  # fallback name -> reason (first seen)
        self.ptrs: dict[str, int] = {}  # parameter -> storage pointer when recorded
        self.order: list[_Copy | _Fill] = []  # every planned write, in recorded order
        self.ordered = False  # destinations overlap: replay strictly in `order`
        self._tainted: dict[str, str] = {}  # parameter -> why it is not planned
        self.verified = False
        self.record_seconds = 0.0
        self._groups: list[tuple[list[int], list[int]]] = []  # filled by _finish
        # still_valid's check, as parallel lists for C-level compares: for every
        # parameter the plan writes, the dict that holds it (its module's
        # _parameters or _buffers), its key there, the object, its address
        self._owner_dicts: list[dict[str, Any]] = []
        self._owner_attrs: list[str] = []
        self._owner_params: list[torch.Tensor] = []
        self._owner_ptrs: list[int] = []
        # layout (bucket sizes + metas) -> per copy (bucket, dtype, element offset in that bucket)
        self._bound: dict[Any, list[tuple[int, torch.dtype, int]]] = {}

    # -------------------------------------------------------------- record
    @classmethod
    def record(
        cls,
        key: Any,
        model: torch.nn.Module,
        load: Callable[[Iterable[tuple[str, torch.Tensor]]], Any],
        named: list[tuple[str, torch.Tensor]],
    ) -> WeightPlan:
        """Run `load(named)` (the model's load_weights) with every write to the
        model's parameters captured instead of performed."""
        t0 = time.perf_counter()
        plan = cls(key)
        params: dict[tuple[str, int], str] = {}
        for pname, p in list(model.named_parameters(remove_duplicate=False)) + list(
            model.named_buffers(remove_duplicate=False)
        ):
            k = _storage_key(p)
            params.setdefault(k, pname)
            plan.ptrs.setdefault(pname, p.untyped_storage().data_ptr())
        rec = _Recorder(params)
        # Source attribution by address: which incoming tensor does a view live in.
        spans = sorted(((*_extent(t), n, t) for n, t in named if t.numel() > 0), key=lambda s: s[0])
        written_by: dict[str, set[str]] = {}  # param -> names
        names_done: set[str] = set()
        with rec:
            load(iter(named))
        plan._plan_writes(rec.raw, spans, written_by, names_done)
        for param, why in rec.tainted.items():
            plan._taint(param, why)
        # A fill is attributed to the names that copied into the same parameter.
        for f in plan.fills:
            names = written_by.get(f.param, set())
            if not names:
                plan._taint(f.param, "filled with no planned copy into it")
            f.name = min(names) if names else ""
        # A tainted parameter: every name that wrote it goes through load_weights.
        for param in list(plan._tainted):
            for n in written_by.get(param, ()):
                plan._fall(n, f"writes {param}, which {plan._tainted[param]}")
        plan._ask_about_unplanned(load, named, params, names_done)
        plan._finish()
        plan._own(model, {op.param for op in plan.order})
        plan.record_seconds = time.perf_counter() - t0
        return plan

    def _plan_writes(
        self,
        raw: list[tuple[str, str, torch.Tensor, Any]],
        spans: list[tuple[int, int, str, torch.Tensor]],
        written_by: dict[str, set[str]],
        names_done: set[str],
    ) -> None:
        """The recorded writes as planned copies and fills, attributed by
        address to the incoming tensor they read; anything else taints its parameter."""
        starts = [s[0] for s in spans]
        for kind, param, dst, obj in raw:
            if kind == "fill":
                self.fills.append(_Fill("", param, dst, obj))  # attributed below
                self.order.append(self.fills[-1])
                continue
            src = obj
            if not isinstance(src, torch.Tensor) or src.device != dst.device:
                self._taint(param, "copied from a tensor on another device")
                continue
            lo, hi = _extent(src)
            i = bisect.bisect_right(starts, lo) - 1
            if i < 0 or not (spans[i][0] <= lo and hi <= spans[i][1]):
                self._taint(param, "copied from a tensor derived from the input")
                continue
            name, base = spans[i][2], spans[i][3]
            if (lo - base.data_ptr()) % src.element_size() or src.dtype != base.dtype:
                self._taint(param, "copied from a reinterpreted view of the input")
                continue
            self.copies.append(
                _Copy(
                    name,
                    param,
                    dst,
                    (lo - base.data_ptr()) // src.element_size(),
                    tuple(src.shape),
                    tuple(src.stride()),
                    src.dtype,
                )
            )
            self.order.append(self.copies[-1])
            written_by.setdefault(param, set()).add(name)
            names_done.add(name)

    def _ask_about_unplanned(
        self,
        load: Callable[[Iterable[tuple[str, torch.Tensor]]], Any],
        named: list[tuple[str, torch.Tensor]],
        params: dict[tuple[str, int], str],
        names_done: set[str],
    ) -> None:
        by_name = dict(named)
        for n, _ in named:
            if n in names_done or n in self.fallback:
                continue
            # No planned write: a name load_weights skips (the tied lm_head.weight of
            # Qwen2) or one it handles out of our sight. Ask load_weights about it
            # alone, still recording: nothing written and nothing reported loaded
            # means skipped; anything else goes through load_weights every time.
            one = _Recorder(params)
            with one:
                loaded = load(iter([(n, by_name[n])]))
            if not one.raw and not one.tainted and loaded is not None and len(loaded) == 0:
                self.skipped.add(n)
            else:
                self._fall(n, "no planned write (left to load_weights)")

    def _taint(self, param: str, why: str) -> None:
        self._tainted.setdefault(param, why)

    def _fall(self, name: str, why: str) -> None:
        self.fallback.add(name)
        self.why.setdefault(name, why)

    def _finish(self) -> None:
        def keep(op: _Copy | _Fill) -> bool:
            return op.name not in self.fallback and op.param not in self._tainted

        self.copies = [c for c in self.copies if keep(c)]
        self.fills = [f for f in self.fills if keep(f)]
        self.order = [op for op in self.order if keep(op)]
        # Overlapping destinations (two writes to one byte): replay in order.
        ext = sorted(_extent(op.dst) for op in self.order if op.dst.numel())
        self.ordered = any(ext[i + 1][0] < ext[i][1] for i in range(len(ext) - 1) if ext[i][0] < ext[i][1])
        # foreach groups: same device, dst/src same shape (copy_ may broadcast otherwise)
        by_dev: dict[torch.device, tuple[list[int], list[int]]] = {}
        for i, c in enumerate(self.copies):
            g = by_dev.setdefault(c.dst.device, ([], []))
            (g[0] if tuple(c.dst.shape) == c.src_size else g[1]).append(i)
        self._groups = list(by_dev.values())

    # -------------------------------------------------------------- use
    @property
    def planned_names(self) -> set[str]:
        return {c.name for c in self.copies}

    def still_valid(self, model: torch.nn.Module | None = None) -> bool:
        """Every parameter the plan writes is still its module's parameter, at
        the address it had when recorded (runs every update: a `map` over dicts
        and one over data_ptr, compared as lists, ~10x a Python loop's speed).
        A re-allocated parameter cannot come back at its old address: the
        plan's views keep the old memory alive."""
        cur = map(dict.get, self._owner_dicts, self._owner_attrs)
        if not all(map(operator.is_, cur, self._owner_params)):
            return False
        return list(map(torch.Tensor.data_ptr, self._owner_params)) == self._owner_ptrs

    def _own(self, model: torch.nn.Module, names: set[str]) -> None:
        for name in sorted(names):
            prefix, _, attr = name.rpartition(".")
            mod = model.get_submodule(prefix) if prefix else model
            d = mod._parameters if attr in mod._parameters else mod._buffers
            p = d.get(attr)
            if p is not None:
                self._owner_dicts.append(d)
                self._owner_attrs.append(attr)
                self._owner_params.append(p)
                self._owner_ptrs.append(p.data_ptr())

    def bind(self, layout: Any, metas: list[list[Any]]) -> list[tuple[int, torch.dtype, int]]:
        """Where each copy's source starts inside the buckets of `layout`
        (cached): sources_from_buckets then needs no per-tensor unpacking."""
        b = self._bound.get(layout)
        if b is None:
            where = {str(m[0]): (int(m[3]), int(m[4])) for m in metas}
            b = []
            for c in self.copies:
                bucket, off = where[c.name]
                isz = c.src_dtype.itemsize
                if off % isz:
                    raise ValueError(f"tensor {c.name!r}: offset {off} not aligned to {c.src_dtype}")
                b.append((bucket, c.src_dtype, off // isz + c.src_offset))
            self._bound = {layout: b}  # one layout at a time
        return b

    def sources_from_buckets(
        self, layout: Any, metas: list[list[Any]], buckets: dict[int, torch.Tensor]
    ) -> list[torch.Tensor]:
        """The source views of every copy, straight from flat uint8 buckets."""
        typed: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        out = []
        for c, (bucket, dt, off) in zip(self.copies, self.bind(layout, metas), strict=True):
            base = typed.get((bucket, dt))
            if base is None:
                raw = buckets[bucket]
                n = raw.numel() // dt.itemsize * dt.itemsize
                base = typed[(bucket, dt)] = raw[:n].view(dt)
            out.append(base.as_strided(c.src_size, c.src_stride, base.storage_offset() + off))
        return out

    def sources(self, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The source views of every copy, cut from this update's tensors."""
        out = []
        for c in self.copies:
            t = tensors[c.name]
            if t.dtype != c.src_dtype:
                raise ValueError(f"tensor {c.name!r}: dtype {t.dtype} != the plan's {c.src_dtype}")
            out.append(t.as_strided(c.src_size, c.src_stride, t.storage_offset() + c.src_offset))
        return out

    def apply(
        self,
        tensors: dict[str, torch.Tensor] | None = None,
        srcs: list[torch.Tensor] | None = None,
        big_bytes: int = BIG_COPY_BYTES,
    ) -> int:
        """Write every planned copy and fill, from this update's named tensors
        (or the sources already cut, `srcs`). Returns the number of copies."""
        if srcs is None:
            srcs = self.sources(tensors or {})
        return self.replay(srcs, big_bytes).run()

    def replay(self, srcs: list[torch.Tensor], big_bytes: int = BIG_COPY_BYTES) -> Replay:
        """The copies from `srcs` (one per copy, as `sources` cuts them) grouped
        for launch. Holds the source views: a worker keeps it across updates
        only while the buffers behind them are kept too (vllm/worker_reuse)."""
        r = Replay(n=len(self.copies))
        if self.ordered:  # the order load_weights wrote them in
            src_of = {id(c): s for c, s in zip(self.copies, srcs, strict=True)}
            r.ordered = [
                (op.dst, src_of[id(op)], None) if isinstance(op, _Copy) else (op.dst, None, op.value)
                for op in self.order
            ]
            return r
        for same, other in self._groups:
            big = [i for i in same if _nbytes(self.copies[i].dst) >= big_bytes]
            small = [i for i in same if _nbytes(self.copies[i].dst) < big_bytes]
            r.big += [(self.copies[i].dst, srcs[i]) for i in big]
            if small:
                r.foreach.append(([self.copies[i].dst for i in small], [srcs[i] for i in small]))
            r.single += [(self.copies[i].dst, srcs[i]) for i in other]
        r.fills = [(f.dst, f.value) for f in self.fills]
        return r

    def verify(self, tensors: dict[str, torch.Tensor]) -> list[str]:
        """After the real load_weights of `tensors`: names whose planned writes
        differ from what load_weights wrote (bit for bit) go to the fallback set.
        Returns them."""
        srcs = self.sources(tensors)
        bad: set[str] = set()
        with torch.no_grad():
            for c, s in zip(self.copies, srcs, strict=True):
                want = torch.empty_like(c.dst).copy_(s)  # copy_'s own cast and broadcast
                if not torch.equal(bits(c.dst), bits(want)):
                    bad.add(c.name)
            for f in self.fills:
                if not torch.equal(bits(f.dst), bits(torch.empty_like(f.dst).fill_(f.value))):
                    bad.add(f.name)
        for n in bad:
            self._fall(n, "load_weights wrote something else than the plan")
        if bad:
            self._finish()
        self.verified = True
        return sorted(bad)

    def summary(self) -> dict[str, Any]:
        return {
            "copies": len(self.copies),
            "fills": len(self.fills),
            "fallback": len(self.fallback),
            "skipped": sorted(self.skipped)[:4],
            "fallback_sample": {n: self.why.get(n, "") for n in sorted(self.fallback)[:4]},
            "ordered": self.ordered,
            "record_seconds": round(self.record_seconds, 4),
        }


def plannable(model: torch.nn.Module) -> str | None:
    """Why this model's weights must always go through load_weights, else None.
    Quantized models (vllm/fp8's business) and non-float parameters are out."""
    if getattr(model, "quant_config", None) is not None:
        return "quantized model"
    for _, p in model.named_parameters():
        if p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return f"parameter dtype {p.dtype}"
    return None
