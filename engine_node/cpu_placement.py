"""CPU placement of a vLLM engine's processes (backend option `cpu_affinity`).

Why: for a small model vLLM's engine core is CPU-bound (one core at 100 % on
an H100/H200 with a 0.5B model: it schedules, prepares inputs and serializes
outputs for every step). The engine node, the head and the client next to it
use 0.1-0.3 of a core each. When the kernel puts one of them on the SMT
sibling of the core's CPU, the core's step rate drops (both hardware threads
share one physical core). `cpu_affinity="auto"` gives the engine core (and
each TP worker) a whole physical core of its own and keeps this node's
process off those cores.

Several engine nodes on one host must not pick the same cores: the slot is
the node's index that launch.py gives it (ROLLOUT_BUS_GPU_SLOT), else its first visible
GPU's number (CUDA_VISIBLE_DEVICES), so
engine g takes the physical cores counted from the END of the allowed list
(the low-numbered CPUs stay with the OS and everything else). A plan that
does not fit leaves everything unpinned (and says why).

`plan()` is pure (tested on CPU with made-up topologies); `apply()` does the
sched_setaffinity calls.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import structlog

log = structlog.get_logger("rollout_bus.cpu_placement")


def read_siblings(cpu: int) -> frozenset[int]:
    """The hardware threads sharing `cpu`'s physical core (itself included)."""
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
            text = f.read().strip()
    except OSError:
        return frozenset({cpu})
    out: set[int] = set()
    for part in text.split(","):
        a, _, b = part.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return frozenset(out)


def physical_cores(
    cpus: Iterable[int], siblings: Callable[[int], frozenset[int]] = read_siblings
) -> list[frozenset[int]]:
    """Allowed CPUs grouped by physical core, in CPU order; a core counts only
    with ALL its threads allowed (a half-allowed core is shared with someone)."""
    allowed = set(cpus)
    seen: set[frozenset[int]] = set()
    cores: list[frozenset[int]] = []
    for c in sorted(allowed):
        sib = siblings(c) or frozenset({c})
        if sib in seen or not sib <= allowed:
            continue
        seen.add(sib)
        cores.append(sib)
    return cores


@dataclass
class Plan:
    dedicated: list[frozenset[int]] = field(default_factory=list)  # one whole core per engine process
    rest: frozenset[int] = frozenset()  # the node (and everything else it starts)
    why_not: str | None = None


def plan(
    cpus: Iterable[int], n_dedicated: int, slot: int, siblings: Callable[[int], frozenset[int]] = read_siblings
) -> Plan:
    """`n_dedicated` whole physical cores for slot `slot`, taken from the end;
    at least two physical cores must stay for the rest."""
    allowed = set(cpus)
    cores = physical_cores(allowed, siblings)
    need = n_dedicated * (slot + 1)
    if n_dedicated < 1:
        return Plan(rest=frozenset(allowed), why_not="nothing to pin")
    if len(cores) < need + 2:
        return Plan(
            rest=frozenset(allowed),
            why_not=f"{len(cores)} whole physical core(s) allowed; slot {slot} needs {need} + 2 for the rest",
        )
    start = len(cores) - need
    mine = cores[start : start + n_dedicated]
    # Every slot's dedicated cores are off-limits to this node, not just ours.
    taken: set[int] = set()
    for c in cores[len(cores) - need :]:
        taken |= c
    return Plan(dedicated=mine, rest=frozenset(allowed - taken))


GPU_SLOT_ENV = "ROLLOUT_BUS_GPU_SLOT"  # launch.py: the engine's index on this host


def gpu_slot(env: Mapping[str, str] | None = None) -> int:
    """This node's slot among the engines of its host: the launcher's
    ROLLOUT_BUS_GPU_SLOT, else the first visible GPU's number (a `GPU-<uuid>`
    mask has none: 0)."""
    src: Mapping[str, str] = os.environ if env is None else env
    if src.get(GPU_SLOT_ENV, "").isdigit():
        return int(src[GPU_SLOT_ENV])
    first = (src.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


def engine_processes(root_pid: int) -> list[int]:
    """vLLM's engine core and worker processes under `root_pid` (by process title)."""
    import psutil

    out = []
    for p in psutil.Process(root_pid).children(recursive=True):
        try:
            title = " ".join(p.cmdline()) + " " + p.name()
        except (psutil.Error, OSError):  # a child that ended or is not ours meanwhile
            continue
        if "EngineCore" in title or "Worker" in title:
            out.append(p.pid)
    return out


def _pin_all_threads(pid: int, cpus: frozenset[int]) -> None:
    """sched_setaffinity(pid) pins one thread (tid == pid): every thread of the
    process is pinned, one by one."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:
            pass  # a thread that ended meanwhile


def apply(mode: str, node_pid: int | None = None) -> dict[str, object]:
    """Pin this node's vLLM processes (mode "auto"); returns what was done."""
    if mode in ("", "off", None):
        return {"cpu_affinity": "off"}
    if mode != "auto":
        raise ValueError(f"cpu_affinity must be 'auto' or 'off', got {mode!r}")
    node_pid = node_pid or os.getpid()
    pids = engine_processes(node_pid)
    p = plan(os.sched_getaffinity(node_pid), len(pids), gpu_slot())
    if p.why_not:
        log.warning("cpu_affinity_skipped", reason=p.why_not)
        return {"cpu_affinity": "skipped", "reason": p.why_not}
    done: dict[str, object] = {"cpu_affinity": "auto"}
    for pid, cores in zip(pids, p.dedicated, strict=True):
        _pin_all_threads(pid, cores)
        done[str(pid)] = sorted(cores)
    _pin_all_threads(node_pid, p.rest)  # threads started later inherit the caller's
    done["node"] = sorted(p.rest)
    log.info("cpu_affinity_applied", **{k: v for k, v in done.items() if k != "cpu_affinity"})
    return done
