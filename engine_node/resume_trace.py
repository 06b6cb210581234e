"""Resume tracing (benchmark hook): where a resume's first token comes from.

One INFO line per resume, event "resume_timing", with milliseconds from the
Resume op to each mark ("admitted": the core re-admitted held / parked
samples; "first_output": the first step with output), plus the vllm backend's
core-side trace when it has one (`trace_outputs` / `take_output_trace`).
bench/gpu_weight_update.py reads these lines. The node's hooks are the calls
to `ResumeTrace.arm` and `ResumeTrace.mark` (engine_node/node.py); removing
this module means removing those two call sites.

Only when requests were parked, held or running at the resume: after an idle
resume the "first output" is a later request's, and its delay (seconds of
nobody asking) read like a stall (issue 23).

Ownership: the node's loop thread.
"""

from __future__ import annotations

import time
from typing import Any


class ResumeTrace:
    def __init__(self, backend: Any, log: Any) -> None:
        self.backend = backend
        self.log = log
        self.marks: dict[str, float] | None = None  # None: not armed

    @property
    def armed(self) -> bool:
        return self.marks is not None

    def arm(self, counters: dict[str, Any]) -> None:
        """A Resume arrived; `counters` are the core's before it runs."""
        if not (counters.get("parked", 0) or counters.get("held", 0) or counters.get("running", 0)):
            self.marks = None
            return
        self.marks = {"t0": time.perf_counter()}
        arm = getattr(self.backend, "trace_outputs", None)  # optional: the vllm backend's core-side trace
        if arm is not None:
            arm()

    def mark(self, name: str) -> None:
        marks = self.marks
        if marks is None or name in marks:
            return
        marks[name] = time.perf_counter()
        if name != "first_output":
            return
        t0 = marks.pop("t0")
        self.marks = None
        take = getattr(self.backend, "take_output_trace", None)
        core = take() if take is not None else None
        self.log.info(
            "resume_timing",
            measures="resume op -> first output of a request the pause held or parked",
            **{f"{k}_ms": round((v - t0) * 1e3, 2) for k, v in marks.items()},
            running=self.backend.num_running(),
            **{f"core_{k}": v for k, v in (core or {}).items()},
        )
