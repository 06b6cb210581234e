"""Process plumbing shared by the node entry points (never by libraries).

`configure_logging` is for entry points only: structlog, console renderer on a
TTY, JSON lines otherwise. `become_child_process` sets the process title and
makes the process die with its parent (Linux PR_SET_PDEATHSIG, plus a watcher
for the case where the parent died before the prctl took effect).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time

import structlog


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
