"""Output: aligned text tables, the machine a run was on, and JSON results in
bench/results/<name>.json (NaN/inf written as null).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from bench.stats import fmt

# Where a benchmark's JSON and PNG go: bench/results (tracked, the recorded runs)
# unless ROLLOUT_BUS_BENCH_OUT names another folder (bench.all sets it: --out).
RESULTS_DIR = Path(os.environ.get("ROLLOUT_BUS_BENCH_OUT") or Path(__file__).resolve().parent / "results")


REPO_ROOT = Path(__file__).resolve().parent.parent


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None, title: str | None = None) -> str:
    """Print rows (dicts) as an aligned text table; returns the text."""
    if not rows:
        text = f"{title or ''}\n(no rows)"
        print(text, flush=True)
        return text
    cols = list(columns) if columns else list(rows[0].keys())
    cells = [[fmt(r.get(c)) for c in cols] for r in rows]  # fmt(str) is the string itself
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = []
    if title:
        lines.append(title)
    lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cols, widths, strict=True))))
    lines.append("  ".join("-" * w for w in widths))
    for row in cells:
        lines.append(
            "  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(row, widths, strict=True)))
        )
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def _git_commit() -> str | None:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5
            ).stdout.strip()
            or None
        )
    except Exception:
        return None


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "hostname": socket.gethostname(),
        "time_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
    }
    try:
        import psutil

        info["cpu_count_physical"] = psutil.cpu_count(logical=False)
        info["mem_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except Exception:
        pass
    return info


@runtime_checkable
class Summarized(Protocol):
    """What JSON keeps of a measurement object (bench.measure.RunResult): its
    summary. A protocol, so this module never imports measure (measure → procs
    → report)."""

    def summary(self) -> dict[str, Any]: ...


def jsonable(o: Any) -> Any:
    """JSON-ready: NaN/inf → None, tuples → lists, RunResult → its summary, paths → str."""
    if isinstance(o, float) and (math.isnan(o) or math.isinf(o)):
        return None
    if isinstance(o, dict):
        return {str(k): jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [jsonable(v) for v in o]
    if isinstance(o, Summarized):
        return o.summary()
    if isinstance(o, Path):
        return str(o)
    return o


def write_json(name: str, payload: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    doc = {"benchmark": name, "machine": machine_info(), **payload}
    path.write_text(json.dumps(jsonable(doc), indent=2, sort_keys=False) + "\n")
    print(f"wrote {shown(path)}", flush=True)
    return path


def shown(path: Path) -> str:
    """`path` relative to the repository when inside it (bench/results/...), else
    as it is (bench.all writes under the temp dir by default)."""
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


# A check a run could not judge (too short to measure it) is None: never a pass.
NOT_JUDGED = "NOT JUDGED"


def verdict(criteria: dict[str, bool | None]) -> tuple[str, int]:
    """(PASS | FAIL | NOT JUDGED, exit code 0 | 1 | 2): FAIL when a check failed;
    NOT JUDGED when none failed but one could not be judged (None)."""
    if any(v is False for v in criteria.values()):
        return "FAIL", 1
    if any(v is None for v in criteria.values()):
        return NOT_JUDGED, 2
    return "PASS", 0


def criterion(v: bool | None) -> str:
    return "PASS" if v else "FAIL" if v is False else NOT_JUDGED
