"""A sampling profiler for the runtime's own processes, for benchmarks on
machines where py-spy cannot attach (no ptrace in the device's sandbox).

`ROLLOUT_BUS_PROFILE_DIR=/some/dir` makes every entry point that calls
`start_from_env(role)` sample its threads' Python stacks every
`ROLLOUT_BUS_PROFILE_INTERVAL_S` (default 0.002 s) and write
`{dir}/{role}-{pid}.txt` (self and inclusive sample shares per function, per
thread) every 5 s and at exit. Off (nothing imported, no thread) without the
variable.

Hazard: the sampler thread takes the GIL at every tick, so the profiled
process runs a little slower; compare profiled runs with profiled runs only.
"""

from __future__ import annotations

import atexit
import collections
import os
import sys
import threading
import time
from typing import Any

ENV_DIR = "ROLLOUT_BUS_PROFILE_DIR"
ENV_INTERVAL = "ROLLOUT_BUS_PROFILE_INTERVAL_S"


class StackSampler:
    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self.samples: collections.Counter[str] = collections.Counter()  # thread name -> samples
        self.leaf: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.incl: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rb-profiler", daemon=True)
        self.started = time.perf_counter()

    def start(self) -> StackSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval_s):
            names = {t.ident: t.name for t in threading.enumerate()}
            for tid, frame in sys._current_frames().items():
                if tid == me:
                    continue
                name = names.get(tid, str(tid))
                self.samples[name] += 1
                seen: set[str] = set()
                f: Any = frame
                first = True
                while f is not None:
                    co = f.f_code
                    key = f"{co.co_name} ({os.path.basename(co.co_filename)}:{co.co_firstlineno})"
                    if first:
                        self.leaf[name][key] += 1
                        first = False
                    if key not in seen:
                        self.incl[name][key] += 1
                        seen.add(key)
                    f = f.f_back

    def report(self, top: int = 30) -> str:
        lines = [f"wall {time.perf_counter() - self.started:.1f}s, interval {self.interval_s * 1e3:.1f} ms"]
        # the loop thread first; threads that only ever sat in one frame (waits) last
        order = sorted(self.samples, key=lambda t: (t != "MainThread", len(self.leaf[t]) <= 1, -self.samples[t]))
        for name in order:
            n = self.samples[name]
            lines.append(f"\n== thread {name}: {n} samples")
            lines.append("-- self")
            lines += [f"{100 * c / n:6.1f}%  {k}" for k, c in self.leaf[name].most_common(top)]
            lines.append("-- inclusive")
            lines += [f"{100 * c / n:6.1f}%  {k}" for k, c in self.incl[name].most_common(top)]
        return "\n".join(lines) + "\n"


def start_from_env(role: str) -> StackSampler | None:
    out = os.environ.get(ENV_DIR)
    if not out:
        return None
    os.makedirs(out, exist_ok=True)
    sampler = StackSampler(float(os.environ.get(ENV_INTERVAL, "0.002"))).start()
    path = os.path.join(out, f"{role}-{os.getpid()}.txt")

    def write() -> None:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write(sampler.report())
        os.replace(tmp, path)

    def periodic() -> None:
        while not sampler._stop.wait(5.0):
            try:
                write()
            except Exception as exc:  # a full disk must not stop the sampler; say so once per period
                print(f"rollout-bus profiler: cannot write its output: {exc!r}", file=sys.stderr)

    threading.Thread(target=periodic, name="rb-profiler-writer", daemon=True).start()
    atexit.register(write)
    return sampler
