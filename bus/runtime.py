"""Process plumbing shared by the node entry points (never by libraries).

`configure_logging` is for entry points only: structlog, console renderer on a
TTY, JSON lines otherwise. `become_child_process` sets the process title and
makes the process die with its parent (Linux PR_SET_PDEATHSIG, plus a watcher
for the case where the parent died before the prctl took effect).
`cannot_start` is how a node that cannot start ends: one line saying why (in
$ROLLOUT_BUS_FATAL_FILE for its launcher, which prints it) and FATAL_EXIT,
which the launcher's supervisor does not restart.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import structlog

# A node that cannot start (a model that does not load, a port that is taken,
# an unknown backend) exits with this code: starting it again would fail the
# same way, so the launcher's supervisor does not (launcher/supervisor.py).
FATAL_EXIT = 78  # sysexits.h EX_CONFIG
FATAL_FILE_ENV = "ROLLOUT_BUS_FATAL_FILE"  # set by the launcher, per child


def configure_logging(level: str | int = "INFO", *, json: bool | None = None) -> None:
    if isinstance(level, str):
        level = getattr(logging, level.upper(), logging.INFO)
    if json is None:
        json = not sys.stderr.isatty()
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        # One write per line (message + newline together): processes sharing a
        # terminal or pipe never splice two JSON objects onto one line.
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=level, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")


def set_title(title: str) -> None:
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except (ImportError, OSError):  # pragma: no cover - cosmetic only: the title is for ps/top
        pass


_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        except OSError:
            pass

    # The parent may have died before prctl ran, or we are not on Linux.
    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os.kill(os.getpid(), sig)
                return
            time.sleep(0.5)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def become_child_process(title: str, *, log_level: str = "INFO") -> None:
    set_title(title)
    if os.environ.get("ROLLOUT_BUS_NO_PDEATHSIG") != "1":
        # ROLLOUT_BUS_PDEATHSIG=SIGKILL: die as if crashed when the parent dies
        # (Ray actors: a killed actor's node must not drain while Ray restarts it).
        name = os.environ.get("ROLLOUT_BUS_PDEATHSIG", "SIGTERM")
        die_with_parent(signal.SIGKILL if name == "SIGKILL" else signal.SIGTERM)
    configure_logging(os.environ.get("ROLLOUT_BUS_LOG_LEVEL", log_level))


def one_line(e: BaseException, limit: int = 400) -> str:
    """`Type: first line of the message`, cut to `limit` characters."""
    first = next((x.strip() for x in str(e).splitlines() if x.strip()), "")
    text = f"{type(e).__name__}: {first}" if first else type(e).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def cannot_start(log: Any, event: str, e: BaseException, **kw: Any) -> int:
    """End a node that cannot start: the reason in one line (to the launcher's
    fatal file when it set one, else as an error log line; the traceback only
    at DEBUG / INFO), and FATAL_EXIT for the process's exit code."""
    reason = one_line(e)
    path = os.environ.get(FATAL_FILE_ENV)
    if path:
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.write(reason)
        except OSError as err:  # the launcher's run folder is gone: it is stopping anyway
            log.warning("fatal_file_unwritable", path=path, error=repr(err))
        log.info(event, reason=reason, exc_info=e, **kw)
    else:
        log.error(event, reason=reason, **kw)
        log.debug(event, exc_info=e, **kw)
    return FATAL_EXIT
